"""`rollout=server`: vLLM's API servers over HTTP. `fleet` (the engine: forming, routing, a server down
and back; `build` makes it from config), `roster` (its servers: given, spawned, identified), `client` (bounded JSON over HTTP),
`process` and `api_server` (a server's command line, rltrain imported first), `guard` (it dies with
its trainer), `images` (image_url parts), `push` and `extension` (the weight push, both ends),
`stream` (in-flight updates: versions pushed mid-generation, finished groups streamed).
docs/rollout-servers.md.
"""
