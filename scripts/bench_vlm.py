"""GRPO on the tiny vision-language model: rltrain's GRPO step vs TRL's GRPOTrainer, same model and data.

Model: `model=tiny_vl` (rltrain/models/tiny_vl.py: a Qwen2-VL with a 2-layer text decoder of hidden
size 64 and a 2-block vision tower), built locally, fp32. Data: an image dataset the script draws
(PIL colour squares of `--image-size` pixels, one per prompt, as files beside a `.jsonl`) in TRL's
vision format: a conversational `prompt` whose user message holds an `{"type": "image"}` part and
the question, and an `images` column. rltrain reads the `.jsonl` (`data.path`); TRL gets the same
rows as a `datasets.Dataset` with the same images decoded. Every row has the same shape (the same
question, images of one size), so every step of both sides has the same prompt lengths whatever
order each side draws its rows in. The reward (written beside the data, called by both) is the
share of the answer's letters in the completion, so samples differ and every step moves the weights.

Both sides: `--prompts` prompts x `--group` completions per step, temperature 1.0, top-p 1.0, no
top-k, at most `--max-new-tokens` new tokens, clipped token-level loss (clip 0.2 / 0.28, no KL,
group-scaled advantages), one optimizer step per generation, constant learning rate, gradient
clipping at 1.0, activations kept (no gradient checkpointing). rltrain runs its own GRPO
(`algo=grpo model=tiny_vl`, built and stepped in-process exactly as `python -m rltrain` builds it:
vLLM's CPU build in-process, or `--rollout hf`). TRL's colocated vLLM path fails on vLLM's CPU
build, so TRL runs `use_vllm=False` (transformers generate), which the output says.

Each side runs in a process of its own, so each one's peak memory is its own: the process's peak
resident set (VmHWM: Python, libraries, model, engine, activations) on CPU, and
`torch.cuda.max_memory_allocated` on CUDA. The steps are interleaved (bench_common.run_interleaved):
rltrain's step k runs right after TRL's step k, while TRL's process waits outside its timed region,
so both see the same machine load. Tokens per step are what each side processed: prompt (with its
visual tokens) + completion, per sequence.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_vlm.py [--steps 4] [--warmup 1] [--prompts 8] [--group 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_common import (
    THREADS_HELP,
    Timing,
    paired_ratio,
    print_table,
    quiet_transformers,
    run_interleaved,
    summarise,
)

import rltrain  # noqa: F401  (before transformers: it makes torchvision importable; docs/vision.md)

LR, CLIP_LOW, CLIP_HIGH = 1e-3, 0.2, 0.28
ROLLOUTS = {"vllm": "rollout=vllm", "hf": "rollout=hf"}  # rltrain rows: the engine each samples with
QUESTION = "Which colour is the square? "
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "yellow": (230, 220, 30),
           "black": (0, 0, 0), "white": (250, 250, 250)}
REWARD_MODULE = "bench_vlm_reward"
REWARD_SOURCE = '''
def colour_letters(prompts, completions, answer, **_):
    """Share of the answer's letters in the completion (text, or TRL's assistant message)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(set(t) & set(a)) / len(set(a)) for t, a in zip(texts, answer)]
'''


@dataclass
class Setup:
    """What both sides are given: the model directory, the data and the step's shape."""

    data_dir: Path
    run_dir: Path
    prompts: int
    group: int
    max_new_tokens: int
    total_steps: int
    threads: int
    rollout: str
    models: Path  # model=tiny_vl is built here (model.cache_dir)
    model_dir: Path | None = None  # its directory, as rltrain's side built it


def write_image_data(data_dir: Path, rows: int, image_size: int) -> Path:
    """`rows` one-image prompts (colour squares) in TRL's vision format, and the reward module."""
    from PIL import Image

    (data_dir / "imgs").mkdir(parents=True)
    names = list(COLOURS)
    lines = []
    for i in range(rows):
        name = names[i % len(names)]
        Image.new("RGB", (image_size, image_size), COLOURS[name]).save(data_dir / "imgs" / f"{i}.png")
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        lines.append(json.dumps({"prompt": prompt, "images": [f"imgs/{i}.png"], "answer": name}))
    (data_dir / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (data_dir / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    return data_dir / "prompts.jsonl"


def peak_memory_gib() -> float:
    """This process's peak: CUDA allocator's on a GPU, else the resident set's high-water mark."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --- rltrain's side: its own process, stepped on request ------------------------------------------


def rltrain_overrides(s: Setup) -> list[str]:
    return [
        "algo=grpo", "model=tiny_vl", f"model.cache_dir={s.models}", f"data.path={s.data_dir / 'prompts.jsonl'}",
        f"reward.fns=[{REWARD_MODULE}:colour_letters]", f"rollout={s.rollout}", "data.eval_fraction=0",
        f"trainer.max_steps={s.total_steps}", "trainer.eval_every=0", "trainer.save_every=0", "trainer.seed=0",
        f"trainer.num_threads={s.threads}", "logger.wandb.mode=disabled",
        f"algo.prompts_per_step={s.prompts}", f"algo.group_size={s.group}", f"algo.max_new_tokens={s.max_new_tokens}",
        "algo.temperature=1.0", "algo.top_p=1.0", "algo.beta=0.0", f"algo.clip_low={CLIP_LOW}",
        f"algo.clip_high={CLIP_HIGH}", "algo.loss_agg=token_mean", "algo.scale_rewards=group",
        f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.max_grad_norm=1.0",
    ]


def build_rltrain_grpo(s: Setup):
    """rltrain's GRPO as `python -m rltrain` builds it for one rank (rltrain.run.trainer.run), so
    its steps can be called one at a time."""
    from hydra import compose, initialize_config_dir

    from rltrain.backends.roles import resolve_role_dirs
    from rltrain.config.run_context import RunContext
    from rltrain.config.schema import CONF_DIR, register_configs
    from rltrain.models.tokenizer import load_tokenizer, with_chat_template_kwargs
    from rltrain.preflight.validate import validate
    from rltrain.run.trainer import build_algorithm, configure_threads, prepare_model_dir, seed_everything
    from rltrain.runtime.distributed import init_distributed
    from rltrain.safety.faults import FaultInjector, parse_faults

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=rltrain_overrides(s))
    validate(cfg)
    dist_info = init_distributed(cfg.safety.collective_timeout_s)
    configure_threads(cfg, dist_info)
    seed_everything(cfg.trainer.seed, dist_info.rank)
    model_dir = prepare_model_dir(cfg, dist_info)
    s.run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = with_chat_template_kwargs(load_tokenizer(model_dir), cfg.data.chat_template_kwargs)
    ctx = RunContext(
        cfg=cfg, run_dir=s.run_dir, dist=dist_info, model_dir=model_dir, tokenizer=tokenizer,
        role_dirs=resolve_role_dirs(cfg, model_dir, tokenizer, dist_info.rank), faults=FaultInjector(parse_faults(cfg.debug.fault), dist_info.rank),
    )
    return build_algorithm(ctx)


def rltrain_process(conn, s: Setup) -> None:
    """Builds rltrain's GRPO, then runs step k whenever the parent sends k; None ends it."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(s.data_dir), os.environ.get("PYTHONPATH", "")])  # reward workers
    sys.path.insert(0, str(s.data_dir))
    quiet_transformers()
    algo = build_rltrain_grpo(s)
    conn.send(str(algo.ctx.model_dir))
    try:
        while (k := conn.recv()) is not None:
            t0 = time.perf_counter()
            metrics = algo.train_step(k + 1)
            conn.send((time.perf_counter() - t0, metrics))
    finally:
        algo.close()
    conn.send(peak_memory_gib())


class RltrainSide:
    """The parent's handle on rltrain's process: `step(k)` runs step k there and returns its Timing."""

    def __init__(self, s: Setup) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rltrain_process, args=(child, s), daemon=False)
        self.proc.start()
        self.metrics: list[dict[str, float]] = []
        self.peak_gib = float("nan")
        self.model_dir = Path(self._expect("its model"))

    def _expect(self, what: str):
        if not self.conn.poll(1800):
            raise RuntimeError(f"rltrain's process sent nothing in 30 minutes (waiting for {what})")
        try:
            return self.conn.recv()
        except EOFError:
            sys.exit(f"rltrain's process ended (exit code {self.proc.join(5) or self.proc.exitcode}); its output is above")

    def step(self, k: int) -> Timing:
        self.conn.send(k)
        seconds, metrics = self._expect(f"step {k}")
        self.metrics.append(metrics)
        return seconds, int(metrics["tokens"])

    def close(self) -> None:
        self.conn.send(None)
        self.peak_gib = self._expect("its peak memory")
        self.proc.join(60)


# --- TRL's side: its own process, pausing after each step --------------------------------------------


def trl_dataset(s: Setup):
    """The same rows as rltrain's `.jsonl`, images decoded (the `datasets` Image feature)."""
    import datasets

    rows = [json.loads(line) for line in (s.data_dir / "prompts.jsonl").read_text().splitlines()]
    for row in rows:
        row["images"] = [str(s.data_dir / p) for p in row["images"]]
    return datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))


def trl_process(conn, s: Setup) -> None:
    """TRL's GRPOTrainer through its normal API; after each timed step it sends (seconds, tokens,
    rollout seconds) and waits for the parent's go, outside the timed region."""
    sys.path.insert(0, str(s.data_dir))
    torch.set_num_threads(s.threads)
    quiet_transformers()
    from bench_common import require_activations_kept, silence_trainer
    from bench_vlm_reward import colour_letters  # type: ignore[import-not-found]
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    work = {"tokens": 0, "completion_tokens": 0, "rollout_s": 0.0, "t0": 0.0}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            require_activations_kept(kw["model"])
            work.update(tokens=0, completion_tokens=0, rollout_s=0.0, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            seconds = time.perf_counter() - work["t0"]
            conn.send((seconds, work["tokens"], work["rollout_s"], work["completion_tokens"] / batch))
            conn.recv()  # the parent ran rltrain's step meanwhile

    batch = s.prompts * s.group
    config = GRPOConfig(
        output_dir=str(s.run_dir / "trl"), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=s.group, max_completion_length=s.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        use_vllm=False, beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, loss_type="dapo", scale_rewards="group",
        num_iterations=1, shuffle_dataset=False, max_steps=s.total_steps, learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, seed=0, bf16=False, fp16=False, gradient_checkpointing=False,
        logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True,
    )
    model = AutoModelForImageTextToText.from_pretrained(s.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(
        model=model, reward_funcs=[colour_letters], args=config, train_dataset=trl_dataset(s),
        processing_class=AutoProcessor.from_pretrained(s.model_dir), callbacks=[StepTimer()],
    )
    silence_trainer(trainer)
    generate, score = trainer._generate_single_turn, trainer._generate_and_score_completions  # timed, not changed

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        work["rollout_s"] += time.perf_counter() - t0
        return out

    def counted_score(*args, **kwargs):
        out = score(*args, **kwargs)
        work["tokens"] += int(out["prompt_mask"].sum() + out["completion_mask"].sum())
        work["completion_tokens"] += int(out["completion_mask"].sum())
        return out

    trainer._generate_single_turn = timed_generate
    trainer._generate_and_score_completions = counted_score
    trainer.train()
    conn.send(("done", peak_memory_gib()))


def run_trl(s: Setup, after_step: Callable[[int], None], trl_rows: list[dict[str, float]]) -> list[Timing]:
    """TRL's process, its step k followed by `after_step(k)` (rltrain's step k) while it waits."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=trl_process, args=(child, s), daemon=False)
    proc.start()
    timings: list[Timing] = []
    while True:
        if not conn.poll(1800):
            raise RuntimeError("TRL's process sent nothing in 30 minutes")
        try:
            msg = conn.recv()
        except EOFError:
            sys.exit(f"TRL's process ended (exit code {proc.join(5) or proc.exitcode}); its output is above")
        if msg[0] == "done":
            trl_rows.append({"peak_gib": msg[1]})
            break
        seconds, tokens, rollout_s, length = msg
        timings.append((seconds, tokens))
        trl_rows.append({"time/rollout": rollout_s, "rollout/response_length_mean": length})
        after_step(len(timings) - 1)
        conn.send("go")
    proc.join(60)
    return timings


# --- the table -----------------------------------------------------------------------------------


def rltrain_row(name: str, ours: list[Timing], side: RltrainSide, warmup: int, trl_tps: float | None) -> list[str]:
    tps, step_s = summarise(ours[warmup:])
    steps = side.metrics[warmup:]
    rollout = statistics.median(m["time/rollout"] for m in steps)
    train = statistics.median(m["time/train"] for m in steps)
    sync = statistics.median(m["time/sync"] for m in steps)
    length = statistics.mean(m["rollout/response_length_mean"] for m in steps)
    return [name, f"{tps:.0f}", f"{step_s:.3f}", f"{rollout:.3f}", f"{train:.3f}", f"{sync:.3f}", f"{length:.1f}",
            f"{side.peak_gib:.2f}", f"{tps / trl_tps:.2f}x" if trl_tps else "-"]


def trl_row(theirs: list[Timing], trl_rows: list[dict[str, float]], warmup: int) -> list[str]:
    steps = [r for r in trl_rows if "time/rollout" in r][warmup:]
    tps, step_s = summarise(theirs)
    rollout = statistics.median(r["time/rollout"] for r in steps)
    train = statistics.median(t - r["time/rollout"] for (t, _), r in zip(theirs, steps))
    length = statistics.mean(r["rollout/response_length_mean"] for r in steps)
    peak = next(r["peak_gib"] for r in trl_rows if "peak_gib" in r)
    return ["TRL GRPOTrainer (use_vllm=False)", f"{tps:.0f}", f"{step_s:.3f}", f"{rollout:.3f}", f"{train:.3f}", "-",
            f"{length:.1f}", f"{peak:.2f}", "1.00x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (engine and allocator warm-up)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=56, help="square images of this many pixels (56: 4 visual tokens)")
    parser.add_argument("--rollout", default="vllm,hf", help="rltrain's rollout engines, one row (and process) each: vllm, hf")
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    args = parser.parse_args()
    rollouts = args.rollout.split(",")
    if not rollouts or any(r not in ROLLOUTS for r in rollouts):
        parser.error(f"--rollout {args.rollout}: choose from {','.join(ROLLOUTS)}, comma-separated")
    total = args.steps + args.warmup
    quiet_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_image_data(root / "data", total * args.prompts, args.image_size)
        sides: dict[str, RltrainSide] = {}
        for rollout in rollouts:
            s = Setup(root / "data", root / f"run-{rollout}", args.prompts, args.group, args.max_new_tokens, total,
                      args.threads, rollout, root / "models")
            sides[f"rltrain GRPO ({ROLLOUTS[rollout]})"] = RltrainSide(s)
        s.model_dir = next(iter(sides.values())).model_dir
        trl_rows: list[dict[str, float]] = []
        ours, theirs = run_interleaved(sides, total, lambda after: run_trl(s, after, trl_rows))
        for side in sides.values():
            side.close()
    theirs = theirs[args.warmup:]
    trl_tps = summarise(theirs)[0] if theirs else None
    rows = [rltrain_row(name, ours[name], side, args.warmup, trl_tps) for name, side in sides.items()]
    notes = []
    if theirs:
        rows.append(trl_row(theirs, trl_rows, args.warmup))
        for name in sides:
            notes.append(f"paired per-step speed-up of {name} (TRL step s / its step s): {paired_ratio(ours[name][args.warmup:], theirs)}")
        notes.append("TRL uses transformers generate (use_vllm=False): its colocated vLLM path fails on vLLM's CPU build. "
                     "TRL's 'train s' is its step minus generation (rewards, log-probs, backward, optimizer); "
                     "rltrain's 'sync s' is the weight load into its rollout engine.")
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    memory = "torch.cuda.max_memory_allocated" if device == "CUDA" else "peak resident set (VmHWM)"
    notes.append(f"peak GiB: each side's own process, {memory}; completion len: mean sampled tokens per completion.")
    notes.append("Machine shared with other jobs: timings are noisy; steps are interleaved so all see the same load.")
    print_table(
        f"GRPO, tiny_vl (Qwen2-VL), {args.prompts} prompts x {args.group} completions, one {args.image_size}x"
        f"{args.image_size} image each, max {args.max_new_tokens} new tokens, {args.steps} timed steps "
        f"(+{args.warmup} warm-up), {args.threads} threads, {device} fp32",
        ["system", "tokens/s", "step s", "rollout s", "train s", "sync s", "completion len", "peak GiB", "tokens/s vs TRL"], rows, notes,
    )


if __name__ == "__main__":
    main()
