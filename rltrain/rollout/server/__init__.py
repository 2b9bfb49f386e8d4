"""`rollout=server`: vLLM's API servers over HTTP. `fleet` (forming, routing, a server down and back;
`build` makes it from config), `batch_requests` (a batch as requests), `roster` (given, spawned, identified,
joined servers), `client` (bounded JSON), `process`/`api_server` (a server's command line, rltrain first,
our `batch_route`/`load_route`), `guard` (dies with its trainer), `images` (image_url parts),
`push`/`extension` (the weight push), `stream` (in-flight updates). docs/rollout-servers.md."""
