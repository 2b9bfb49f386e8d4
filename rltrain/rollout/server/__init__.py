"""`rollout=server`: vLLM's API servers over HTTP as the rollout engine. `fleet` (the engine: forming,
routing, a server down and back), `roster` (its servers: given once, spawned, identified), `client`
(JSON over HTTP, bounded), `process` (a server's command line, spawned servers), `guard` (a spawned
server dies with its trainer), `push` and `extension` (the weight push: the trainer's end, the
server's vLLM worker extension). docs/rollout-servers.md.
"""
