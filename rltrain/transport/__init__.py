"""Weights across a process boundary: the trainer's `sender` streams tensors through fixed-size
shared-memory buckets (`shm`, packed by `buckets`) with JSON metadata on a Unix socket (`wire`,
`protocol`), and the rollout process's `receiver` unpacks them. docs/internals/sync.md.
"""
