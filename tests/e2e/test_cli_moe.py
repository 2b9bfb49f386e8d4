"""Mixture-of-Experts runs end to end (docs/moe.md): GRPO on the tiny MoE from its SFT start
(model=tiny_moe_sft, a short SFT here) with vLLM in process, every expert synced each step and
the engine's log-probabilities the trainer's to fp32 round-off, the router losses off and the load
measured; SFT with the router losses on; the transformers engine, and in `slow` a separate vLLM
process and vLLM API servers (each tens of seconds more to start). On `backend=megatron` (2 ranks,
`backend.ep` 2 and 1): a separate vLLM process per rank at ep=2, and in `slow` the other engines,
generating ahead and ep=1."""

from __future__ import annotations

import pytest
from cli import read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

MOE_GRPO = [
    "algo=grpo", "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=4", "trainer.max_steps=2",
    "trainer.save_every=0", "trainer.eval_every=0", "logger.wandb.mode=disabled", "trainer.progress=lines",
]
PARITY = 1e-3  # rollout/logprob_diff_max in fp32 (docs/moe.md)


def assert_engine_samples_the_trainers_weights(run_dir, steps: int) -> None:
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/logprob_diff_max"] < PARITY, r


def test_grpo_on_the_tiny_moe_sft_start_syncs_every_expert_to_vllm_and_replays_its_routing(tiny_cache, tmp_path):
    """With router replay on (docs/moe.md, "Recording in vLLM"): vLLM's record of the experts that
    sampled each token is, at every (token, layer), the FSDP trainer's own routing of it in fp32 with
    synced weights (agreement 1.0: a router that missed a sync would route otherwise)."""
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe_sft", "model.sft_steps=4", "algo.router_replay=true", run_dir=run_dir, timeout=500)
    assert_engine_samples_the_trainers_weights(run_dir, 2)
    for r in train_rows(run_dir):  # RL keeps the router losses off unless set; the load is measured
        assert 1.0 <= r["moe/load_imbalance"] <= 8 / 2 and "moe/aux_loss" not in r and "moe/z_loss" not in r, r
        assert r["moe/router_agreement"] == 1.0, r
    with safe_open(run_dir / "final" / "model.safetensors", "pt") as f:  # a checkpoint like the one loaded
        names = set(f.keys())
    assert {f"model.layers.3.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names
    starts = list((tiny_cache / "models").glob("tiny-qwen3_moe-*-sft-*"))
    assert starts and all((s / "sft_metrics.jsonl").exists() for s in starts)


def test_sft_on_the_tiny_moe_adds_the_router_losses_it_is_given(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", "model=tiny_moe", "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001",
            "trainer.max_steps=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.eval_every=0",
            "trainer.save_every=0", "logger.wandb.mode=disabled", run_dir=run_dir, timeout=300)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 and 1.0 <= r["moe/load_imbalance"] <= 4.0, r


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(["rollout=hf"], id="hf"),
        pytest.param(["rollout.process=separate"], id="separate", marks=pytest.mark.slow),
        pytest.param(["rollout=server", "rollout.servers.spawn=1"], id="server", marks=pytest.mark.slow),
    ],
)
def test_grpo_on_the_tiny_moe_with_each_engine(engine, tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", "trainer.max_steps=3", *engine, run_dir=run_dir, timeout=600)
    assert_engine_samples_the_trainers_weights(run_dir, 3)
    assert read_metrics(run_dir)
    # Every engine records the routing of a MoE (a server on vLLM's CPU build too): the agreement is measured with replay off
    assert all(0.9 <= r["moe/router_agreement"] <= 1.0 for r in train_rows(run_dir))


@pytest.mark.slow
def test_sft_router_losses_on_megatron_are_fsdps(tiny_cache, tmp_path):
    """model.moe.aux_loss_coef / z_loss_coef on `backend=megatron backend.ep=2` (activation
    checkpointing on: the kept router logits backward through the recomputation) log and train what
    they do on FSDP2 over the same 2 ranks' micro-batches (docs/moe.md, "On megatron")."""
    sft = ["algo=sft", "model=tiny_moe", "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001",
           "trainer.nproc=2", "trainer.max_steps=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
           "trainer.eval_every=0", "trainer.save_every=0", "logger.wandb.mode=disabled"]
    rltrain(*sft, run_dir=tmp_path / "fsdp", timeout=400)
    rltrain(*sft, "backend=megatron", "backend.ep=2", "model.gradient_checkpointing=true", run_dir=tmp_path / "megatron",
            timeout=400)
    fsdp, megatron = train_rows(tmp_path / "fsdp"), train_rows(tmp_path / "megatron")
    assert len(fsdp) == len(megatron) == 2
    for one, two in zip(fsdp, megatron):
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/load_imbalance"):
            assert two[key] == pytest.approx(one[key], rel=1e-5), (key, one, two)


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(["backend.ep=2", "rollout.process=separate"], id="ep2-separate"),
        pytest.param(["backend.ep=1", "rollout.process=separate"], id="ep1-separate", marks=pytest.mark.slow),
        *(
            pytest.param([f"backend.ep={ep}", *args], id=f"ep{ep}-{name}", marks=pytest.mark.slow)
            for ep in (2, 1)
            for name, args in (
                ("server", ["rollout=server", "rollout.servers.spawn=1"]),
                ("hf", ["rollout=hf"]),
                ("ahead", ["rollout.process=separate", "placement.max_staleness=1"]),
            )
        ),
    ],
)
def test_grpo_on_the_tiny_moe_on_megatron_with_each_engine(engine, tiny_cache, tmp_path):
    """`backend=megatron` on 2 ranks (`backend.ep=2`: each rank holds 4 of a layer's 8 experts; 1:
    every expert, 2 data-parallel replicas) syncs every expert to each rollout engine (docs/moe.md,
    "What runs where"): a separate vLLM process per rank, vLLM API servers, the transformers
    engine, and generating one step ahead; the engine's log-probabilities are the trainer's to fp32
    round-off on every step that measures them (generating ahead: the first, docs/async.md), the
    load (`moe/load_imbalance`) is logged with the router losses off, and `final/` holds every expert."""
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    ahead = "placement.max_staleness=1" in engine
    steps = 3 if ahead else 2
    rltrain(*MOE_GRPO, "model=tiny_moe", "backend=megatron", "trainer.nproc=2", f"trainer.max_steps={steps}", *engine,
            run_dir=run_dir, timeout=600)
    if ahead:  # steps 2 and 3 train on batches version 1 and 2 sampled, one behind the trainer
        rows = train_rows(run_dir)
        assert [r["step"] for r in rows] == [1, 2, 3] and [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
        assert rows[0]["rollout/logprob_diff_max"] < PARITY
        assert all(r.get("rollout/logprob_diff_max", 0.0) < PARITY for r in rows), rows
    else:
        assert_engine_samples_the_trainers_weights(run_dir, steps)
    for r in train_rows(run_dir):
        assert 1.0 <= r["moe/load_imbalance"] <= 8 / 2 and "moe/aux_loss" not in r and "moe/z_loss" not in r, r
    with safe_open(run_dir / "final" / "model.safetensors", "pt") as f:  # every expert, gathered over the ep ranks
        experts = {name for name in f.keys() if ".mlp.experts." in name}  # noqa: SIM118 - not iterable
    assert len(experts) == 4 * 8 * 3  # layers x experts x (gate, up, down)


# One rank is `slow`: two ranks replay each rank's own record, a superset.
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_grpo_on_the_tiny_moe_replays_the_transformers_engines_routing(nproc, tiny_cache, tmp_path):
    """algo.router_replay=true (docs/moe.md, "Router replay"): every trainer forward routes the sampled
    tokens as the engine did, on one rank and on two data-parallel ranks; parity holds and the
    agreement of the engine's routing with the trainer's own router is logged."""
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", "rollout=hf", "algo.router_replay=true", f"trainer.nproc={nproc}",
            run_dir=run_dir, timeout=600)
    assert_engine_samples_the_trainers_weights(run_dir, 2)
    assert all(0.9 <= r["moe/router_agreement"] <= 1.0 for r in train_rows(run_dir))


# `slow`: megatron's replay of a recorded routing is tests/dist/backends/test_megatron_router_replay.py's,
# a run replaying an engine's record test_grpo_on_the_tiny_moe_replays_the_transformers_engines_routing's
# (FSDP), both in make test; the record's layout is the engines' common one (`Completion.routing`).
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_grpo_on_megatron_with_expert_parallelism_replays_the_engines_routing(engine, tiny_cache, tmp_path):
    """algo.router_replay=true on backend=megatron backend.ep=2 (2 ranks, each its own tokens through
    the all-to-all; docs/moe.md, "Router replay"), the transformers engine's record or vLLM's:
    parity every step in fp32, the agreement logged."""
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", f"rollout={engine}", "algo.router_replay=true", "backend=megatron",
            "backend.ep=2", "trainer.nproc=2", run_dir=run_dir, timeout=600)
    assert_engine_samples_the_trainers_weights(run_dir, 2)
    assert all(0.9 <= r["moe/router_agreement"] <= 1.0 for r in train_rows(run_dir))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_moe_recipe_raises_heldout_accuracy_with_router_replay(tiny_cache, tmp_path, seed):
    """`python -m rltrain +experiment=grpo_moe trainer.seed=S` (issue 74 point 7, docs/moe.md, "It
    learns"): the tiny MoE from its SFT start, GRPO on the transformers engine with router replay on,
    raises held-out exact-match accuracy by at least 0.15 on the 1000 held-out problems; every step
    replays the engine's routing (the agreement logged) and samples the trainer's weights."""
    run_dir = tmp_path / "run"
    rltrain("+experiment=grpo_moe", f"trainer.seed={seed}", "logger.wandb.mode=disabled", "trainer.progress=lines",
            run_dir=run_dir, timeout=3600)
    rows = read_metrics(run_dir)
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 60 and all(0.5 <= r["moe/router_agreement"] <= 1.0 for r in trained)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 60, evals
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.15, evals


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement",
    [
        [],
        ["placement.max_staleness=1"],
        ["placement.max_staleness=1", "placement.weight_update=in_flight", "trainer.eval_every=2"],
        ["placement.max_staleness=1", "placement.weight_update=in_flight", "placement.stream=true", "trainer.eval_every=2"],
    ],
    ids=["synchronous", "ahead", "in_flight", "in_flight_stream"],
)
def test_grpo_on_the_tiny_moe_replays_the_separate_vllm_engines_routing(placement, tiny_cache, tmp_path):
    """algo.router_replay=true with vLLM in its own process (docs/moe.md, "Recording in vLLM"): the
    record crosses the control channel with each completion. Synchronous, every step samples the
    trainer's weights, so the record is the trainer's own routing (agreement 1.0) and parity holds.
    Generating ahead, a batch sampled by the weights one update behind is replayed: the first step's
    batch is the trainer's (agreement 1.0, parity), the later ones show the routing the update moved.
    In flight (with and without streaming) each request's record is taken as its samples finish
    (docs/moe.md, "Recording in flight"): each token's experts from the version that sampled it;
    an evaluation's requests run among them unrecorded."""
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", "rollout.process=separate", "algo.router_replay=true", "trainer.max_steps=3",
            *placement, run_dir=run_dir, timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    synchronous = rows if not placement else rows[:1]
    for r in synchronous:
        assert r["rollout/logprob_diff_max"] < PARITY and r["moe/router_agreement"] == 1.0, r
    assert all(0.5 <= r["moe/router_agreement"] <= 1.0 for r in rows), rows
    if "trainer.eval_every=2" in placement:  # evaluated inside the stream, among recorded requests
        assert 2 in [r["step"] for r in read_metrics(run_dir) if "eval/accuracy" in r]
    print("\nagreement by step:", [r["moe/router_agreement"] for r in rows])
    print("logprob_diff_max by step:", [r.get("rollout/logprob_diff_max") for r in rows])
    print("versions per sequence (max) by step:", [r.get("rollout/versions_per_sequence_max") for r in rows])


@pytest.mark.slow
def test_grpo_on_the_tiny_moe_replays_the_servers_routing_in_flight(tiny_cache, tmp_path):
    """algo.router_replay=true over a server with weights in flight and streaming (docs/moe.md,
    "Recording in a server"): each group goes through rltrain's batch route, whose answer carries
    the record beside the weight-version spans; the agreement is logged every step, 1.0 with
    parity at step 1 (sampled by the trainer's weights)."""
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", "rollout=server", "rollout.servers.spawn=1", "algo.router_replay=true",
            "trainer.max_steps=3", "placement.max_staleness=1", "placement.weight_update=in_flight",
            "placement.stream=true", run_dir=run_dir, timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["rollout/logprob_diff_max"] < PARITY and rows[0]["moe/router_agreement"] == 1.0, rows[0]
    assert all(0.5 <= r["moe/router_agreement"] <= 1.0 for r in rows), rows
    print("\nagreement by step:", [r["moe/router_agreement"] for r in rows])
    print("versions per sequence (max) by step:", [r.get("rollout/versions_per_sequence_max") for r in rows])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["one_rank", "two_ranks"])
def test_grpo_on_the_tiny_moe_replays_the_servers_routing(nproc, tiny_cache, tmp_path):
    """algo.router_replay=true with rollout=server (docs/moe.md, "Recording in a server"): the
    tap in the spawned API server's worker records each completion of rltrain's batch route under
    the route's own key, so with 2 trainer ranks on one server (their requests at once, their seeds
    alike) each completion gets its own record: the trainer's routing (agreement 1.0 in fp32 with
    synced weights) and parity every step."""
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", "rollout=server", "rollout.servers.spawn=1", "algo.router_replay=true",
            f"trainer.nproc={nproc}", run_dir=run_dir, timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < PARITY and r["moe/router_agreement"] == 1.0, r
