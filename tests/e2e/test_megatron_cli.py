"""`backend=megatron` from the command line, on the embedded default (issue 5, end to end).

What each test pins, with the fewest runs that can (every run is a real `python -m rltrain`
process; megatron runs use 2 ranks over gloo):

- SFT at (tp, pp) = (2, 1) and (1, 2) gives FSDP's loss rows on one rank within 1e-5 relative
  (the same data, the same init, so any gap is the backend's);
- the (2, 1) run's `final/` is a Hugging Face directory: transformers loads it, tensor names and
  shapes are FSDP's, and the weights are FSDP's up to what 4 AdamW steps of a warm-up lr can move;
- a megatron run killed after a checkpoint resumes to exactly the uninterrupted rows;
- DPO runs on 2 data-parallel replicas; GRPO with tp=2 keeps `rollout/logprob_diff_max` below 1e-3 (the engine gets
  merged full tensors, and the two TP ranks train on the completions one of them generated);
- megatron-core's import/forward noise (Apex, Transformer Engine, cuda_graph_scope,
  CUDA_DEVICE_MAX_CONNECTIONS) never reaches the user;
- an impossible layout fails at config time with a one-paragraph message;
- GRPO on a tiny Qwen3-MoE with expert parallelism (`backend.ep=2`, 2 data-parallel replicas)
  samples from the trainer's weights through vLLM's CPU MoE kernel in process (`rollout/logprob_diff_max`
  below 1e-3), and its `final/` holds every expert (gathered from both replicas); `slow`: the same
  export through a separate vLLM process per rank, and `final/`, are in `make test` by
  tests/e2e/test_cli_moe.py's `test_grpo_on_the_tiny_moe_on_megatron_with_each_engine[ep2-separate]`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from cli import QUICK, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

# Small data: evaluation (always at the last step) and dataset building stay cheap.
SMALL_SFT = ["algo=sft", "trainer.max_steps=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
             "data.num_eval=8", *QUICK]
MEGATRON_TP2 = ["backend=megatron", "backend.tp=2", "trainer.nproc=2"]
MEGATRON_PP2 = ["backend=megatron", "backend.pp=2", "trainer.nproc=2"]
COMPARED = ("loss", "grad_norm", "lr", "tokens")
NOISE = ("Apex is not installed", "Transformer Engine and Apex", "full scope is deprecated", "CUDA_DEVICE_MAX_CONNECTIONS")


@pytest.fixture
def fsdp_sft(shared_runs) -> Path:
    return shared_runs.get(*SMALL_SFT, "trainer.nproc=1")


@pytest.fixture
def megatron_tp2_sft(shared_runs) -> tuple[Path, str]:
    """Checkpoints every 2 steps: the uninterrupted run the resume test compares with (a shared run,
    so it runs once whichever pytest-xdist worker asks first)."""
    run_dir, _, stderr = shared_runs.get_with_output(*SMALL_SFT, *MEGATRON_TP2, "trainer.save_every=2")
    return run_dir, stderr


def _assert_same_training(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3, 4]
    for row, ref in zip(rows, reference, strict=True):
        for key in COMPARED:
            assert row[key] == pytest.approx(ref[key], rel=1e-5), (row["step"], key)


def test_tp2_sft_equals_fsdp_and_is_quiet(fsdp_sft, megatron_tp2_sft):
    run_dir, stderr = megatron_tp2_sft
    _assert_same_training(train_rows(run_dir), train_rows(fsdp_sft))
    for noise in NOISE:
        assert noise not in stderr, noise


@pytest.mark.slow  # pp=2 against transformers at engine level: tests/dist/backends/test_megatron_engine.py; a pp=2 CLI run: test_safety_megatron_cli.py
def test_pp2_sft_equals_fsdp(fsdp_sft, tmp_path):
    run_dir = tmp_path / "run"
    rltrain(*SMALL_SFT, *MEGATRON_PP2, run_dir=run_dir)
    _assert_same_training(train_rows(run_dir), train_rows(fsdp_sft))


@pytest.mark.parametrize("backend", [[], ["backend=megatron"]], ids=["fsdp", "megatron"])
def test_fused_adamw_trains_like_each_backends_own_kernels(fsdp_sft, tmp_path, backend):
    """`optim.implementation=fused` (rltrain/backends/adamw.py) takes each backend's steps up to
    round-off, and megatron checkpoints its state. The fused kernel rounds differently from
    megatron's per-tensor loop, so there some number differs in its last bits: the key reached the
    optimizer. FSDP's foreach kernel and the fused one round alike on some CPUs (this machine's
    kind among them), so for FSDP the kernel built is held by tests/unit/backends/test_adamw.py."""
    own = fsdp_sft
    if backend:
        own = tmp_path / "own"
        rltrain(*SMALL_SFT, *backend, run_dir=own)
    run_dir = tmp_path / "fused"
    rltrain(*SMALL_SFT, *backend, "optim.implementation=fused", "trainer.save_every=2", run_dir=run_dir)
    rows, reference = train_rows(run_dir), train_rows(own)
    _assert_same_training(rows, reference)
    if backend:
        assert any(row[key] != ref[key] for row, ref in zip(rows, reference, strict=True) for key in COMPARED)


def test_final_is_a_hugging_face_model_with_fsdps_weights(fsdp_sft, megatron_tp2_sft):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = megatron_tp2_sft[0] / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    assert model(ids).logits.shape[-1] == model.config.vocab_size

    ours, theirs = load_file(final / "model.safetensors"), load_file(fsdp_sft / "final" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    # AdamW moves a weight by at most ~lr per step whatever its gradient, so two backends whose
    # gradients differ by round-off can differ by at most the sum of the 4 warm-up lrs (2e-4) x 2.
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape and tensor.dtype == theirs[name].dtype, name
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=5e-4, msg=name)


def test_killed_megatron_run_resumes_to_the_uninterrupted_result(megatron_tp2_sft, tmp_path):
    whole = megatron_tp2_sft[0]
    run_dir = tmp_path / "killed"
    common = [*SMALL_SFT, *MEGATRON_TP2, "trainer.save_every=2"]
    # Rank 1 SIGKILLs itself at the start of step 3, after step 2's checkpoint is complete.
    killed = rltrain(*common, "debug.fault=kill:1:3", run_dir=run_dir, check=False)
    assert killed.returncode != 0
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    assert not (run_dir / "final").exists()

    resumed = rltrain(*common, run_dir=run_dir)
    assert "resumed from" in resumed.stdout

    def comparable(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in rows]

    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(whole))
    assert (run_dir / "final" / "model.safetensors").exists()


def test_dpo_on_megatron_data_parallel(tiny_cache, tmp_path):
    """tp = pp = 1 on 2 ranks: two data-parallel replicas, each with its own share of the pairs
    (DPO at pp=2 against a plain computation is tests/dist/algos/test_dpo_ragged.py)."""
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", "backend=megatron", "trainer.nproc=2", "trainer.max_steps=2", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4", "data.num_eval=8", *QUICK, run_dir=run_dir)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # The policy starts as the reference: the first sigmoid DPO loss is exactly -log(sigmoid(0)).
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[1]["loss"] != rows[0]["loss"]


def test_grpo_with_tensor_parallel_keeps_rollout_and_trainer_logprobs_equal(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=grpo", *MEGATRON_TP2, "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=2",
            "data.num_eval=8", *QUICK, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3
        assert math.isfinite(row["loss"]) and 0.0 <= row["reward/mean"] <= 1.0
    assert any(r.get("eval/reward") is not None for r in read_metrics(run_dir))


def test_impossible_layout_is_a_config_error(tiny_cache, tmp_path):
    proc = rltrain("algo=sft", "backend=megatron", "backend.tp=2", "trainer.nproc=3", *QUICK,
                   run_dir=tmp_path / "run", check=False, timeout=120)
    assert proc.returncode == 2
    assert "trainer.nproc=3 is not divisible by backend.tp * backend.pp" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()


def _tiny_qwen3_moe(path: Path) -> Path:
    """8 experts, top-2, the character tokenizer; heads of 32 (vLLM's CPU attention's smallest)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rltrain.models.tokenizer import build_char_tokenizer, padded_vocab_size

    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=padded_vocab_size(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_grpo_with_expert_parallelism_samples_the_trainers_moe(tmp_path):
    from safetensors import safe_open

    model = _tiny_qwen3_moe(tmp_path / "moe")
    run_dir = tmp_path / "run"
    rltrain("algo=grpo", "backend=megatron", "backend.ep=2", "trainer.nproc=2", f"model.path={model}",
            "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=3", "data.num_eval=8", *QUICK[1:],
            run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # every step: the experts of each update reached vLLM (its CPU MoE kernels repacked)
        assert row["rollout/logprob_diff_max"] < 1e-3 and math.isfinite(row["loss"]), row
    with safe_open(str(run_dir / "final" / "model.safetensors"), framework="pt") as saved:
        experts = {name for name in saved.keys() if ".mlp.experts." in name}  # noqa: SIM118 - not iterable
    assert len(experts) == 2 * 8 * 3  # layers x experts x (gate, up, down)
