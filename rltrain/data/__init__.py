"""Data: the ragged batch every per-token quantity travels in (`ragged`, `batch`), the built-in task
(`tasks`), loading and tokenizing user files (`loading`, `tokenize`, `*_data`), and splitting work
between ranks and micro-batches (`sampler`, `sharding`). docs/configuration.md lists the data keys.
"""
