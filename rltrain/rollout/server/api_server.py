"""vLLM's OpenAI-compatible API server (`rollout=server`), started as
`python -m rltrain.rollout.server.api_server <vllm serve arguments>` so that rltrain is imported first.

Importing rltrain prepares what a vision-language model needs before transformers and vLLM look
for it (a torchvision beside the CPU torch), in the server's process and in the engine-core process
vLLM spawns from it, which re-imports this module as its main module. Started as vLLM's own
`python -m vllm.entrypoints.openai.api_server`, both would import transformers first and miss it
(docs/vision.md). The app vLLM builds gets two routes of ours: batched generation
(rollout/server/batch_route.py) and the weight push's load (rollout/server/load_route.py).
"""

from collections.abc import Callable
from typing import Any

import rltrain  # noqa: F401  (first: see the module doc)


def with_routes(build_app: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `build_app` with rltrain's routes added."""

    def build(*args: Any, **kwargs: Any) -> Any:
        from rltrain.rollout.server import batch_route, load_route

        app = build_app(*args, **kwargs)
        app.include_router(batch_route.router)
        app.include_router(load_route.router)
        return app

    return build


if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server import entry

    from rltrain.rollout.vllm_cpu_sampler import use_eager_rank_count

    use_eager_rank_count()  # on a CPU the engine samples in this process (server_env)
    entry.build_app = with_routes(entry.build_app)
    entry.main()
