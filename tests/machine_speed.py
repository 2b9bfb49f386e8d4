"""How fast this machine trains, so that one machine's `make test` time can be compared with another's.

The probe is a few SFT-like training steps (forward, backward, AdamW) of the benchmarks' ~10M-parameter
Qwen2 shape (scripts/bench_common.py, `bench_model_dir`) on one thread, built in memory from a fixed
seed: the work that dominates the suite's CPU time, measured the same way everywhere. It reports tokens
per second; the suite's summary prints it beside pytest's wall time (docs/testing.md, "What the suite
costs", has the reference machine's pair).
"""

from __future__ import annotations

import time

BATCH, SEQ_LEN, WARMUP_STEPS, TIMED_STEPS = 4, 128, 1, 4


def probe_tokens_per_s() -> float:
    """Tokens per second of the timed training steps (one thread; the caller's thread count is restored)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=128, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                             num_key_value_heads=4, intermediate_size=1024, tie_word_embeddings=True,
                             attn_implementation="sdpa")
        model = Qwen2ForCausalLM(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        seconds = 0.0
        for step in range(WARMUP_STEPS + TIMED_STEPS):
            start = time.perf_counter()
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= WARMUP_STEPS:
                seconds += time.perf_counter() - start
        return TIMED_STEPS * BATCH * SEQ_LEN / seconds
    finally:
        torch.set_num_threads(threads)
