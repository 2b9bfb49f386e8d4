"""The Hugging Face + FSDP2 training engine (`engine`) and its parts: process groups (`groups`),
start-up sharding (`sharding`), how a micro-batch meets the model (`micro_batches/`: layouts,
shared-prompt and padding-free packing, attention masks), scoring (`hf_scoring`), compiled layers,
weight export (`export`) and checkpoints (`checkpoint`). docs/backends.md compares it with Megatron.
"""
