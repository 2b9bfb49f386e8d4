"""Models: the embedded tiny Qwen2 model and tokenizer (`tiny`, `tokenizer`), its SFT'd copy
(`tiny_sft`), a tiny reward model (`tiny_reward`), which directory a run loads (`model_dir`), Hub ids
resolved through huggingface_hub's cache (`hub`), LoRA adapters (`lora`) and loading it once then
broadcasting (`hf_io`).
"""
