"""vLLM's OpenAI-compatible API server (`rollout=server`), started as
`python -m rltrain.rollout.server.api_server <vllm serve arguments>` so that rltrain is imported first.

Importing rltrain prepares what a vision-language model needs before transformers and vLLM look
for it (a torchvision beside the CPU torch), in the server's process and in the engine-core process
vLLM spawns from it, which re-imports this module as its main module. Started as vLLM's own
`python -m vllm.entrypoints.openai.api_server`, both would import transformers first and miss it
(docs/vision.md). The app vLLM builds gets one route of ours, rollout/server/batch_route.py.
"""

import rltrain  # noqa: F401  (first: see the module doc)

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server import entry

    from rltrain.rollout.server.batch_route import with_batch_route

    entry.build_app = with_batch_route(entry.build_app)
    entry.main()
