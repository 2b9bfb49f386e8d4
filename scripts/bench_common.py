"""What every benchmark script shares: the benchmark model, a single-rank process group, quiet
libraries, timing summaries, the printed table and the step-by-step interleaving with TRL.

The scripts import from here, never from each other.
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

Timing = tuple[float, int]  # (seconds, tokens) of one optimizer step
THREADS_HELP = (
    "torch intra-op threads, the same for both sides (default 1: on the shared 2-core machines a "
    "second OpenMP thread mostly waits at barriers for a descheduled peer, which measures the "
    "scheduler, not the code; use 2+ on a quiet machine)"
)


def bench_model_dir(cache: Path) -> Path:
    """The ~10M-parameter model every benchmark uses (head size 32, as vLLM's CPU attention needs)."""
    from rltrain.config import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(
        hidden_size=384, num_layers=6, num_heads=12, num_kv_heads=4, intermediate_size=1024,
        tie_word_embeddings=True, cache_dir=str(cache),
    )
    return build_tiny_model_dir(cfg, seed=0)


def count_params(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def init_single_rank(port: int) -> None:
    """rltrain's engines expect a process group; one rank over gloo has no communication cost."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))


def quiet_transformers() -> None:
    """Progress bars and warnings would drown the table."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    datasets.disable_progress_bars()


def disable_length_buckets(engine) -> None:
    """Ablation: score every micro-batch as one rectangle padded to its longest sequence (what the
    engine did before length buckets), to show what the buckets buy."""
    engine.bucket_cost = None


def silence_trainer(trainer) -> None:
    """With progress bars off, Trainer prints its log dicts instead; the table is the output."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def summarise(results: list[Timing]) -> tuple[float, float]:
    """(tokens/s over all timed steps, median step seconds)."""
    return sum(n for _, n in results) / sum(t for t, _ in results), statistics.median(t for t, _ in results)


def print_table(title: str, header: list[str], rows: list[list[str]], notes: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) + 2 for i in range(len(header))]
    print(f"\n{title}")
    print("".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in rows:
        print("".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for note in notes:
        print(note)


def paired_ratio(ours: list[Timing], theirs: list[Timing]) -> str:
    """Median (min-max) of TRL step time / rltrain step time over the same batches."""
    ratios = sorted(t / o for (o, _), (t, _) in zip(ours, theirs))
    return f"{statistics.median(ratios):.2f}x (min {ratios[0]:.2f}, max {ratios[-1]:.2f}, {len(ratios)} steps)"


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def run_interleaved(
    systems: dict, total: int, run_trl: Callable[[Callable[[int], None]], list[Timing]]
) -> tuple[dict[str, list[Timing]], list[Timing]]:
    """Time our systems step by step, each step k right after TRL's step k (from TRL's callback,
    outside its timed region) so both see the same machine load. Without TRL, ours run alone."""
    ours: dict[str, list[Timing]] = {name: [] for name in systems}

    def our_steps(k: int) -> None:
        for name, system in systems.items():
            ours[name].append(system.step(k))

    theirs: list[Timing] = []
    if trl_available():
        theirs = run_trl(our_steps)
    else:
        print("TRL is not importable: install trl==1.16.0 to compare")
        for k in range(total):
            our_steps(k)
    return ours, theirs
