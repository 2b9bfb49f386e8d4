"""Data: the ragged batch every per-token quantity travels in (`ragged`, `batch`), the built-in task
(`tasks`), loading user files and Hub datasets and tokenizing them (`loading`, `row_maps`, `tokenize`,
`*_data`), and splitting work between ranks and micro-batches (`sampler`, `sharding`).
docs/models-and-data.md explains the data keys.
"""
