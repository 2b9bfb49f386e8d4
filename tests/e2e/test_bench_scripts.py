"""The benchmark scripts at their smallest sizes, so none can rot between benchmark runs: the GPU
benchmark on CPU (small model), the CPU benchmarks beside TRL (pinned with the test tools,
requirements/), LoRA's memory table and the weight-sync transports. Timings are printed, never
asserted (bench_fleet.py, minutes long, runs by hand: docs/rollout-servers.md)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from cli import ROOT, python
from helpers import free_port

pytestmark = pytest.mark.e2e


def test_bench_gpu_names_an_unknown_workload_before_building_anything():
    proc = python("scripts/bench_gpu.py", "--only", "sft,ppo", "--no-trl", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unknown workload(s) ppo; choose from plain,sft,dpo,grpo" in proc.stderr, proc.stderr


def test_bench_gpu_runs_the_plain_loop_beside_rltrain_on_dense_rows_and_profiles_each(tmp_path):
    proc = python("scripts/bench_gpu.py", "--model", "small", "--only", "plain,sft", "--backend", "fsdp,megatron",
                  "--rows", "dense", "--length", "64",
                  "--batch", "4", "--micro", "2", "--steps", "1", "--warmup", "0", "--no-trl", "--threads", "1",
                  "--profile", str(tmp_path), "--port", str(free_port()), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 dense rows of 64 tokens/step" in proc.stdout, proc.stdout
    table = {line.rsplit(None, 5)[0]: line.rsplit(None, 5)[1:] for line in proc.stdout.splitlines()
             if line.startswith(("plain loop", "rltrain "))}
    assert list(table) == ["plain loop", "plain loop, chunked CE", "rltrain sft", "rltrain sft (megatron)"], proc.stdout
    assert all(float(cells[0]) > 0 for cells in table.values()), proc.stdout
    for name in ["rltrain sft", "rltrain sft (megatron)"]:  # vs the plain loop with the same (full) head
        assert float(table[name][3].rstrip("x")) > 0, proc.stdout
    assert "'plain loop' row (the plain loop with rltrain's output head)" in proc.stdout, proc.stdout
    for name in table:
        assert f"profile of one step, dense {name} (" in proc.stdout, proc.stdout
    assert proc.stdout.count("top 8 by self host time: aten::") == 4, proc.stdout
    assert proc.stdout.count("optimizer step: host ") == 4, proc.stdout
    traces = sorted(p.name for p in tmp_path.iterdir())
    assert traces == ["dense_plain_loop.json.gz", "dense_plain_loop_chunked_CE.json.gz", "dense_rltrain_sft.json.gz",
                      "dense_rltrain_sft_megatron.json.gz"]


def _script(name: str):
    """A module of scripts/ (not a package), imported by path; registered as dataclasses need."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_plain_loop_chunked_cross_entropy_equals_the_full_logits_one():
    plain = _script("gpu_plain_loop")
    torch.manual_seed(0)
    hidden_NH = torch.randn(7, 5, requires_grad=True)
    weight_VH = torch.randn(11, 5, requires_grad=True)
    targets_N = torch.randint(0, 11, (7,))
    full = F.cross_entropy(hidden_NH @ weight_VH.t(), targets_N, reduction="sum")
    grads = torch.autograd.grad(full, [hidden_NH, weight_VH])
    old, plain.CHUNK_ELEMENTS = plain.CHUNK_ELEMENTS, 33  # chunks of 3 positions: 3 + 3 + 1
    try:
        chunked = plain.chunked_ce_sum(hidden_NH, weight_VH, targets_N)
    finally:
        plain.CHUNK_ELEMENTS = old
    chunked_grads = torch.autograd.grad(chunked, [hidden_NH, weight_VH])
    torch.testing.assert_close(chunked, full)
    for got, want in zip(chunked_grads, grads):
        torch.testing.assert_close(got, want)


def test_profile_summary_shares_of_the_step():
    profile = _script("gpu_profile")
    op = profile.OpTime
    ops = [
        op("aten::mm", False, 300.0, 0.0, 300.0, 400.0),
        op("Optimizer.step#AdamW.step", False, 50.0, 0.0, 150.0, 100.0),
        op("c10d::allreduce_", False, 100.0, 0.0, 100.0, 0.0),
        op("aten::broadcast_tensors", False, 50.0, 0.0, 50.0, 0.0),  # no collective
        op("sm90_gemm_kernel", True, 0.0, 400.0, 0.0, 400.0),
        op("ncclDevKernel_AllReduce", True, 0.0, 100.0, 0.0, 100.0),
        op("multi_tensor_apply_kernel", True, 0.0, 100.0, 0.0, 100.0),
    ]
    assert profile.summarize(ops, 1000.0, on_device=True, top=2) == [
        "top 2 by self device time: sm90_gemm_kernel 40.0%; ncclDevKernel_AllReduce 10.0%",
        "communication: host 10.0%, device 10.0%",
        "optimizer step: host 15.0%, device 10.0%",
        "device idle: 40.0% (step minus kernel time)",
        "host in ops: 50.0% (their self times: launches, Python inside ranges, syncs)",
    ]
    assert profile.summarize(ops, 1000.0, on_device=False, top=1) == [
        "top 1 by self host time: aten::mm 30.0%",
        "communication: host 10.0%",
        "optimizer step: host 15.0%",
    ]


@pytest.mark.slow  # bench_gpu runs in make test on dense rows (above); TRL beside in bench_sft and bench_dpo (below)
def test_bench_gpu_runs_every_workload_on_cpu_with_trl_beside_it():
    """Every workload's rltrain row, and TRL's (pinned with the test tools, requirements/) beside it."""
    proc = python("scripts/bench_gpu.py", "--only", "sft,dpo,grpo", "--steps", "1", "--warmup", "0", "--batch", "4",
                  "--micro", "2", "--group", "2", "--threads", "1", "--port", str(free_port()), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = {line.split()[1]: line.split() for line in proc.stdout.splitlines() if line.startswith("rltrain ")}
    assert set(ours) == {"sft", "dpo", "grpo"}, proc.stdout
    for name, cells in ours.items():
        assert float(cells[2]) > 0 and float(cells[3].rstrip("%")) > 0, (name, cells)
        assert cells[-1].endswith("x") and float(cells[-1][:-1]) > 0, (name, cells)
    trl_rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("TRL 1.16 ")]
    assert [cells[2] for cells in trl_rows] == ["SFTTrainer", "DPOTrainer", "GRPOTrainer"], proc.stdout
    for cells in trl_rows:
        assert float(cells[-5]) > 0 and cells[-1] == "1.00x", cells
    assert "warning" not in proc.stdout, proc.stdout  # both sides counted the same tokens


def test_bench_rewards_prints_the_direct_call_the_pool_and_the_sandboxes():
    proc = python("scripts/bench_rewards.py", "--prompts", "2", "--group", "2", "--workers", "1", "--repeats", "1",
                  "--executions", "4", "--sandbox-workers", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pool, sandboxes = proc.stdout.strip().split("\n\n")
    rows = [line.rsplit(None, 1) for line in pool.splitlines()[2:]]
    assert [name for name, _ in rows] == ["direct call", "pool, 1 worker(s), a call per group"], proc.stdout
    assert all(float(ms) > 0 for _, ms in rows)
    rates = [line.split() for line in sandboxes.splitlines()[2:]]
    assert [(mode, workers) for mode, workers, _ in rates] == [("bwrap", "2"), ("rlimits", "2")], proc.stdout
    assert all(float(rate) > 0 for _, _, rate in rates)  # every execution passed (the script exits 1 otherwise)


def test_bench_async_names_an_unknown_workload_or_mode_before_running_anything():
    proc = python("scripts/bench_async.py", "--workloads", "long-tail,short", "--modes", "sync,k=3", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--workloads: unknown short; choose from default, long-tail" in proc.stderr, proc.stderr


def test_bench_async_table_puts_each_mode_beside_sync_and_k1_of_its_workload(capsys):
    bench = _script("bench_async")
    row = {"time/rollout": 0.5, "time/train": 0.25, "rollout/response_length_mean": 9.0, "idle": 0.1}
    results = {("long-tail", "1/1", mode): {**row, "time/step": step}
               for mode, step in (("sync", 1.0), ("k=1", 0.8), ("in-flight+stream", 0.6))}
    bench.print_tables(results, bench.argparse.Namespace(steps=4, warmup=1, repeat=2, extra=[]), cores=2)
    lines = {line.split()[2]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("long-tail")}
    assert lines["in-flight+stream"][-3:] == ["0.60x", "0.75x", "1.20x"], lines  # vs sync, vs k=1, vs alone (0.5 s)
    assert lines["sync"][-3:] == ["1.00x", "1.25x", "2.00x"], lines


def test_bench_moe_table_puts_each_layout_beside_trl(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its sibling bench_common, as when run as a script
    bench = _script("bench_moe")
    step = {"time/step": 2.0, "time/rollout": 1.0, "time/train": 0.5, "tokens_per_s": 1000.0, "rollout/tokens_per_s": 500.0}
    ours = {"FSDP2, 1 rank": ([step], [1.25]), "megatron ep=2, 2 ranks": ([{**step, "time/step": 4.0}], [1.5, 1.25])}
    trl = [{"time/step": 8.0, "time/rollout": 6.0, "rollout_tokens": 300.0, "tokens": 4000.0}]
    rows = {r[0]: r[1:] for r in bench.table_rows(ours, trl, trl_peak_gib=1.0)}
    assert rows["FSDP2, 1 rank"] == ["2.000", "1.000", "0.500", "1000", "500", "1.25", "0.25"], rows
    assert rows["megatron ep=2, 2 ranks"][-2:] == ["1.50 / 1.25", "0.50"], rows  # each rank's peak; step over TRL's
    assert rows["TRL GRPOTrainer (use_vllm=False)"] == ["8.000", "6.000", "2.000", "500", "50", "1.00", "1.00"], rows
    alone = {r[0]: r[-1] for r in bench.table_rows(ours, [], trl_peak_gib=0.0)}  # without TRL: over the first row
    assert alone == {"FSDP2, 1 rank": "1.00", "megatron ep=2, 2 ranks": "2.00"}, alone


@pytest.mark.slow
def test_bench_moe_runs_fsdp_and_expert_parallel_megatron_beside_trl():
    """bench_moe.py at its smallest: a CLI run per layout (one rank under FSDP2, two under megatron
    ep=2) and TRL's GRPOTrainer, each row with positive timings and each rank's peak memory."""
    proc = python("scripts/bench_moe.py", "--rows", "fsdp,ep2", "--steps", "1", "--warmup", "0",
                  "--max-new-tokens", "4", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _table_rows(proc.stdout, "FSDP2, 1 rank", "megatron ep=2, 2 ranks", "TRL GRPOTrainer (use_vllm=False)")
    assert len(rows) == 3, proc.stdout
    assert all(float(cells[0]) > 0 and float(cells[3]) > 0 for cells in rows.values()), rows
    ep2 = rows["megatron ep=2, 2 ranks"]  # step, rollout, train, tok/s, rollout tok/s, peak / peak, ratio
    assert len(ep2) == 9 and ep2[6] == "/" and float(ep2[5]) > 0.1 and float(ep2[7]) > 0.1, ep2


def _table_rows(stdout: str, *names: str) -> dict[str, list[str]]:
    """The cells after each named row's label, keyed by label."""
    return {name: line[len(name):].split() for line in stdout.splitlines() for name in names if line.startswith(name)}


@pytest.mark.parametrize(
    "script, args, ours",
    [
        ("bench_sft", ["--steps", "1", "--warmup", "0", "--batch", "4"], "rltrain (FSDP engine)"),
        ("bench_dpo", ["--steps", "1", "--warmup", "0", "--pairs", "4"], "rltrain (FSDP engine)"),
        # bench_grpo runs the CLI beside TRL's GRPOTrainer, which bench_gpu's run above drives too: `slow`.
        pytest.param("bench_grpo", ["--model", "tiny", "--steps", "1", "--warmup", "0", "--max-new-tokens", "4"],
                     "rltrain GRPO (vLLM CPU rollout)", marks=pytest.mark.slow),
    ],
)
def test_the_cpu_benchmarks_print_rltrain_beside_trl(script, args, ours):
    """Each CPU benchmark at its smallest: rltrain's row and TRL's, with positive timings and the ratio column."""
    port = [] if script == "bench_grpo" else ["--port", str(free_port())]  # bench_grpo runs the CLI
    proc = python(f"scripts/{script}.py", *args, *port, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = {"bench_sft": "TRL SFTTrainer", "bench_dpo": "TRL DPOTrainer", "bench_grpo": "TRL GRPOTrainer"}[script]
    rows = _table_rows(proc.stdout, ours, theirs)
    assert set(rows) == {ours, theirs}, proc.stdout
    assert all(float(cell) > 0 for cell in rows[ours][:2]), rows
    assert rows[theirs][-1] in ("1.00x", "1.00"), rows
    assert float(rows[ours][-1].rstrip("x")) > 0, rows


# slow: the benchmarks' shared table code runs in make test through bench_sft and bench_dpo; LoRA's training
# runs in test_cli_lora.py.
@pytest.mark.slow
def test_bench_lora_prints_full_and_lora_with_their_ratios():
    proc = python("scripts/bench_lora.py", "--model", "small", "--only", "sft", "--warmup", "0", "--threads", "1",
                  "--port", str(free_port()), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("sft ")]
    assert [cells[1] for cells in rows] == ["full", "lora"], proc.stdout
    full, lora = rows
    assert float(lora[2].rstrip("M")) < float(full[2].rstrip("M"))  # trainable parameters
    assert float(lora[-2]) > 0 and float(lora[-1]) > 0, lora  # memory ratio, time ratio


def test_bench_sync_prints_every_transport_for_a_cell():
    proc = python("scripts/bench_sync.py", "--params", "1e6", "--buckets-mb", "4", "--repeats", "1", "--grpo-steps", "0",
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [cell] = [line.split("|") for line in proc.stdout.splitlines() if line.strip().startswith("1.0M")]
    assert len(cell) == 4 and all(float(part.split()[-2]) > 0 for part in cell[1:]), proc.stdout  # ms of each transport


def test_bench_long_refuses_a_cp_that_does_not_divide_the_heads_before_building_anything():
    proc = python("scripts/bench_long.py", "--heads", "8", "--cp", "1,3", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--cp [3]: each cp must be at least 1 and divide --heads=8" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_bench_long_prints_memory_per_rank_at_cp_1_and_2_and_the_longest_fitting():
    proc = python(
        "scripts/bench_long.py", "--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--lengths", "64,128", "--cp", "1,2", "--max-gib", "64", "--longest-cap", "256", timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "activation vs cp=1" in proc.stdout and "longest sequence fitting --max-gib 64.0" in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.startswith(("1 ", "2 "))]) == 6
