"""Data across a process boundary: the trainer's `sender` streams weights through fixed-size
shared-memory buckets (`shm`, packed by `buckets`) with JSON metadata on a Unix socket (`wire`,
`protocol`), and the rollout process's `receiver` unpacks them; `http_json` is one bounded JSON
request over HTTP (the rollout servers', the LLM judge's). docs/internals/sync.md.
"""
