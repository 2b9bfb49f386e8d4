"""How an FSDP micro-batch meets the model (`layout.MicroBatchLayout` chooses): packed rows of shared
prompts (`shared_prefix`), one padding-free row (`padding_free`), length buckets or one padded
rectangle, which rows with images always take (`vision_layout`); the attention masks of packed rows (`attention_masks`) and flex_attention under autocast
(`flex_autocast`); the few widths a compiled model's packed rows are padded to (`widths`).
docs/internals/backends.md.
"""
