"""Several machines (docs/launching.md, "Several machines"): two torchrun agents on 127.0.0.1, one rank each,
joined by a c10d rendezvous as two nodes would be, train exactly as one `trainer.nproc=2` launch:
the same `loss` on every step, for SFT and GRPO, in one shared run directory. A "node" that sees
another directory at the run directory's path (a private mount namespace with a tmpfs over it)
makes the run refuse to start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli import QUICK, ROOT, SMALL_SFT_RUN_2_RANKS, ranks_forked, rltrain, torchrun_ranks_env, train_rows
from helpers import cuda_machine, free_port

pytestmark = pytest.mark.e2e

TORCHRUN = Path(sys.executable).parent / "torchrun"
RUNS = {
    # SFT: the shared 2-rank run is the local launch (tests/cli.py); the nodes run its settings.
    "sft": [a for a in SMALL_SFT_RUN_2_RANKS if a != "trainer.nproc=2"],
    "grpo": ["algo=grpo", "rollout=hf", "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2", "data.num_eval=8", *QUICK],
}
SHORT_TIMEOUT = ["safety.collective_timeout_s=60"]  # a rank left alone fails instead of hanging


def two_node_command(node_rank: int, port: int, args: list[str], run_dir: Path) -> list[str]:
    """The README's several-machines command, with 127.0.0.1 as the first node's address."""
    return [
        str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rltrain-two-nodes",
        "-m", "rltrain", *args, f"hydra.run.dir={run_dir}",
    ]


def run_two_nodes(args: list[str], run_dir: Path, logs: Path, node1_prefix: tuple[str, ...] = (),
                  timeout: float = 500, env: dict[str, str] | None = None) -> tuple[list[int], str]:
    """Both nodes' exit codes and their output."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [*(node1_prefix if node == 1 else ()), *two_node_command(node, port, args, run_dir)]
        with open(logs / f"node{node}.log", "w") as log:  # files, not pipes: neither node blocks on output
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, **(env or {}))))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, "\n".join((logs / f"node{n}.log").read_text() for n in (0, 1))


# GRPO over two nodes (each node's engines, its rows gathered) is `slow`: the launch is the same as SFT's.
@pytest.mark.parametrize("algo", [pytest.param(a, marks=pytest.mark.slow) if a == "grpo" else a for a in sorted(RUNS)])
def test_two_nodes_train_like_two_local_ranks(shared_runs, tmp_path, algo):
    args = [*RUNS[algo], *SHORT_TIMEOUT]
    # The ranks torchrun starts are forked from the rank server (tests/cli.py `torchrun_ranks_env`),
    # as a local launch's are (with GRPO, their reward workers too); the refused node below keeps
    # fresh ones: a forked rank would not be in its mount namespace.
    if algo == "sft":
        local_dir = shared_runs.get(*SMALL_SFT_RUN_2_RANKS)
        launch_forks = 2
    else:
        local_dir = tmp_path / "local"
        before = ranks_forked() if not cuda_machine() else 0
        rltrain(*args, "trainer.nproc=2", run_dir=local_dir, timeout=500)
        launch_forks = ranks_forked() - before if not cuda_machine() else 0
        assert cuda_machine() or launch_forks >= 2
    forked = ranks_forked() if not cuda_machine() else 0
    codes, output = run_two_nodes(args, tmp_path / "nodes", tmp_path, env=torchrun_ranks_env())
    assert codes == [0, 0], output[-6000:]
    assert cuda_machine() or ranks_forked() - forked == launch_forks
    local, nodes = train_rows(local_dir), train_rows(tmp_path / "nodes")
    assert [r["step"] for r in nodes] == [r["step"] for r in local] == list(range(1, len(local) + 1))
    assert [r["loss"] for r in nodes] == [r["loss"] for r in local]  # the same two processes, so bitwise
    assert (tmp_path / "nodes" / "final" / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "nodes" / "heartbeats").iterdir()) == ["rank-0.json", "rank-1.json"]


def private_tmpfs_prefix(mount_point: Path) -> tuple[str, ...]:
    """A command prefix that runs the command in its own mount namespace, with an empty tmpfs over
    `mount_point`: a machine that does not share that directory. Skips where that is refused."""
    prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs tmpfs "$0" && exec "$@"', str(mount_point))
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a private mount namespace here (needs root and unshare)")
    return prefix


def test_a_node_that_does_not_share_the_run_directory_is_refused(tiny_cache, tmp_path):
    run_dir = tmp_path / "nodes"
    run_dir.mkdir()
    codes, output = run_two_nodes([*RUNS["sft"], *SHORT_TIMEOUT], run_dir, tmp_path,
                                  node1_prefix=private_tmpfs_prefix(run_dir), timeout=300)
    assert all(code != 0 for code in codes), output[-6000:]
    # torchrun's report: the refusing rank exited 2. Its peer on the other node exits 2 as well or,
    # when its agent sees the failed rendezvous first (a loaded machine), is stopped by that agent.
    assert output.count("exitcode  : 2") >= 1, output[-6000:]
    # Whichever node joined first is rank 0 and writes the token in the directory it sees; the other
    # node's rank, rank 1, cannot see it. The paragraph is printed once, by rank 0.
    assert output.count("cannot see the run directory") == 1, output[-6000:]
    assert f"rltrain: error: rank(s) 1 cannot see the run directory {run_dir} that rank 0 uses" in output
    assert not (run_dir / "metrics.jsonl").exists()
