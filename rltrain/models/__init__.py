"""Models: the embedded tiny Qwen2 model and tokenizer (`tiny`, `tokenizer`), its SFT'd copy
(`tiny_sft`), a tiny reward model (`tiny_reward`), which directory a run loads (`model_dir`), LoRA
adapters (`lora`), mixture-of-experts models under FSDP2 (`moe`) and loading a model
once then broadcasting it (`hf_io`).
"""
