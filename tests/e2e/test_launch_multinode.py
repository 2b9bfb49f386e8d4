"""Several machines (README, "Several machines"): two torchrun agents on 127.0.0.1, one rank each,
joined by a c10d rendezvous as two nodes would be, train exactly as one `trainer.nproc=2` launch:
the same `loss` on every step, for SFT and GRPO, in one shared run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli import QUICK, ROOT, rltrain, train_rows
from helpers import free_port

pytestmark = pytest.mark.e2e

TORCHRUN = Path(sys.executable).parent / "torchrun"
RUNS = {
    "sft": ["algo=sft", "trainer.max_steps=3", "trainer.global_batch_size=8"],
    "grpo": ["algo=grpo", "rollout=hf", "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2"],
}
SHORT_TIMEOUT = ["safety.collective_timeout_s=60"]  # a rank left alone fails instead of hanging


def two_node_command(node_rank: int, port: int, args: list[str], run_dir: Path) -> list[str]:
    """The README's several-machines command, with 127.0.0.1 as the first node's address."""
    return [
        str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rltrain-two-nodes",
        "-m", "rltrain", *args, f"hydra.run.dir={run_dir}",
    ]


def run_two_nodes(args: list[str], run_dir: Path, logs: Path, timeout: float = 500) -> None:
    port = free_port()
    procs = []
    for node in (0, 1):
        with open(logs / f"node{node}.log", "w") as log:  # files, not pipes: neither node blocks on output
            procs.append(subprocess.Popen(two_node_command(node, port, args, run_dir), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = "\n".join((logs / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], output


@pytest.mark.parametrize("algo", sorted(RUNS))
def test_two_nodes_train_like_two_local_ranks(tiny_cache, tmp_path, algo):
    args = [*RUNS[algo], *QUICK, *SHORT_TIMEOUT]
    rltrain(*args, "trainer.nproc=2", run_dir=tmp_path / "local", timeout=500)
    run_two_nodes(args, tmp_path / "nodes", tmp_path)
    local, nodes = train_rows(tmp_path / "local"), train_rows(tmp_path / "nodes")
    assert [r["step"] for r in nodes] == [r["step"] for r in local] == list(range(1, len(local) + 1))
    assert [r["loss"] for r in nodes] == pytest.approx([r["loss"] for r in local], rel=1e-6, abs=1e-9)
    assert (tmp_path / "nodes" / "final" / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "nodes" / "heartbeats").iterdir()) == ["rank-0.json", "rank-1.json"]
