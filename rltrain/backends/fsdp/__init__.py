"""The Hugging Face + FSDP2 training engine (`engine`) and its parts: process groups (`groups`),
start-up sharding (`sharding`), the micro-batch layout (`layout`), scoring (`hf_scoring`),
shared-prompt and padding-free packing (`shared_prefix`, `padding_free`, `attention_masks`,
`flex_autocast`), compiled layers, weight export (`export`) and checkpoints (`checkpoint`).
docs/backends.md compares it with the Megatron engine.
"""
