"""The train/rollout mismatch of a MoE with and without router replay (docs/moe.md, "Router
replay"), where the engine and the trainer route differently:

    .venv/bin/python scripts/router_replay_mismatch.py MODEL_DIR bf16    # the engine in bf16, the trainer in fp32
    .venv/bin/python scripts/router_replay_mismatch.py MODEL_DIR stale   # the trainer's weights one change ahead

The transformers engine samples 4 completions of 32 addition prompts (it records each sampled
token's experts); an FSDP engine on one rank scores them, replay off then on, and the script prints
`rollout/mismatch_kl`'s and `rollout/logprob_diff_*`'s quantities over those tokens with the
router agreement. `stale` adds N(0, (0.02 x the tensor's std)^2) to every trainer weight, a policy
that moved since the engine's weights (what `placement.max_staleness` gives, which rollout=hf does
not run). MODEL_DIR: a MoE checkpoint, e.g. the cached `model=tiny_moe` (~/.cache/rltrain/models).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("setting", choices=["bf16", "stale"])
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29637"), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)

    from rltrain.algos.rl.completion_records import recorded_routing
    from rltrain.algos.rollout_correction import mismatch_kl_sum
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig, HFRolloutConfig
    from rltrain.data.batch import SequenceBatch
    from rltrain.data.ragged import Ragged
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.rollout.base import SamplingSettings
    from rltrain.rollout.hf import HFRolloutEngine

    tok = load_tokenizer(args.model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [tok(f"{int(a)}+{int(b)}=")["input_ids"] for a, b in torch.randint(0, 100, (32, 2), generator=g)]
    engine = HFRolloutEngine(args.model_dir, HFRolloutConfig(), dtype="bfloat16" if args.setting == "bf16" else "float32")
    completions = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=8, seed=1))
    batch = SequenceBatch.from_lists([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions])
    batch.routing = recorded_routing(completions)
    engine_logps = Ragged.from_lengths(torch.tensor([x for c in completions for x in c.logprobs]), batch.completion_lens())
    for replay in (False, True):
        trainer = FSDPEngine(args.model_dir, FSDPBackendConfig(), None, 1, torch.device("cpu"), router_replay=replay)
        if args.setting == "stale":
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for p in trainer.lm.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.std().clamp_min(1e-3))
        old = trainer.forward_logps([batch])[0].policy_logps()
        assert trainer.replay is not None, "a MoE model"
        counts = trainer.replay.agreement()
        agreement = float(counts[0] / counts[1]) if counts is not None else float("nan")
        diff = (old.values - engine_logps.values).abs()
        kl = float(mismatch_kl_sum(old, engine_logps)) / old.num_tokens
        print(
            f"{args.setting} replay={replay}: tokens={old.num_tokens} router_agreement={agreement:.4f} mismatch_kl={kl:.3e} "
            f"logprob_diff_max={float(diff.max()):.3e} logprob_diff_mean={float(diff.mean()):.3e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
