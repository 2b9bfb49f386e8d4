"""Hostile completions against the code reward's sandbox (rltrain/rewards/sandbox), for real: each
harm under bubblewrap (and, where rlimits-only mode promises it, without) harms nothing here, scores
0 and is counted; nothing of the execution's user id outlives it. Small limits keep each case to a
second or two."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from rltrain.config.schema import SandboxConfig
from rltrain.rewards.code import run_tests
from rltrain.rewards.sandbox.local import MAX_SLOTS, UID_BASE
from rltrain.rewards.sandbox.settings import CodeSettings, check
from rltrain.runtime.errors import UserError

IO = {"inputs": [""], "outputs": ["3"]}  # what the hostile programs would print if their harm worked


# Code that ends by itself (a refused call, MemoryError) gets a wall clock a loaded machine never
# reaches; code that never ends (loops, fork bombs, floods) a short one.
ENDS, NEVER_ENDS = 20.0, 1.5


def settings(mode: str, timeout_s: float) -> CodeSettings:
    cfg = SandboxConfig(mode=mode, timeout_s=timeout_s, cpu_s=int(timeout_s) + 1, memory_mb=256, processes=8, output_bytes=65536,
                        workers=2, tmp_mb=8, file_size_mb=1)
    return CodeSettings(sandbox=cfg)


def run_hostile(code: str, mode: str = "bwrap", expected: str = "3", timeout_s: float = ENDS) -> tuple[float, set[str]]:
    """(its reward, its executions' statuses); afterwards no process of a sandbox user is left."""
    columns = {"input_output": [{"inputs": [""], "outputs": [expected]}]}
    scored = run_tests([f"```python\n{code}\n```"], columns, settings(mode, timeout_s))[0]
    leftovers = sandboxed_by(os.getpid())
    assert not leftovers, f"processes of the sandbox's user ids outlived the execution: {leftovers}"
    assert subprocess.run(["true"]).returncode == 0  # this machine still starts processes
    return scored.passed / scored.total, scored.statuses


def sandboxed_by(starter: int) -> list[int]:
    """Live processes under the user ids that process `starter` gives its executions (other tests'
    sandboxes, in other processes, are not ours to count)."""
    first = UID_BASE + starter * MAX_SLOTS
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and first <= os.stat(f"/proc/{entry}").st_uid < first + MAX_SLOTS:
                found.append(int(entry))
        except OSError:
            pass
    return found


MODES = ["bwrap", "rlimits"]  # the harms both modes stop (rlimits: as root, a user id of its own)


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_bomb_is_contained_and_killed(mode):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    reward, statuses = run_hostile(bomb, mode, timeout_s=NEVER_ENDS)
    assert reward == 0.0 and statuses & {"timeout", "error", "killed"}


@pytest.mark.parametrize("mode", MODES)
def test_unbounded_allocation_fails_at_the_memory_limit(mode):
    reward, statuses = run_hostile("x = []\nwhile True:\n    x.append(bytearray(10**7))\nprint(3)", mode)
    assert reward == 0.0 and statuses == {"error"}  # MemoryError at reward.sandbox.memory_mb


@pytest.mark.parametrize("mode", MODES)
def test_an_infinite_loop_is_stopped_at_the_timeout(mode):
    reward, statuses = run_hostile("while True:\n    pass", mode, timeout_s=NEVER_ENDS)
    assert reward == 0.0 and statuses == {"timeout"}


def test_writing_outside_its_directory_reaches_nothing(tmp_path):
    targets = [tmp_path / "pwned.txt", tmp_path / "sub" / "pwned.txt"]
    (tmp_path / "sub").mkdir()
    for target in targets:
        reward, statuses = run_hostile(f"open({str(target)!r}, 'w').write('pwned')\nprint(3)")
        assert reward == 0.0 and statuses == {"error"}
        assert not target.exists()
    reward, _ = run_hostile(f"import sys\nopen(sys.prefix + '/pwned-{secrets.token_hex(4)}', 'w')\nprint(3)")  # its interpreter: read-only
    assert reward == 0.0


def test_reading_a_secret_outside_its_directory_fails(tmp_path, capfd):
    secret = "s3cret-" + secrets.token_hex(8)
    path = tmp_path / "secret.txt"
    path.write_text(secret)
    reward, statuses = run_hostile(f"print(open({str(path)!r}).read())", expected=secret)  # it would pass if it read it
    assert reward == 0.0 and statuses == {"error"}
    reward, _ = run_hostile(f"print(open({os.path.abspath('pyproject.toml')!r}).read()[:5])", expected="[buil")  # the run's directory
    assert reward == 0.0


def test_a_listener_on_this_machine_receives_nothing():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hello')\nprint(3)"
        reward, statuses = run_hostile(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever arrived
    assert reward == 0.0 and statuses == {"error"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", ["parent", "init", "trainer", "trainer_group", "neighbour"])
def test_signals_reach_no_other_process(mode, target):
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        call = {
            "parent": "os.kill(os.getppid(), 9)", "init": "os.kill(1, 9)", "trainer": f"os.kill({os.getpid()}, 9)",
            "trainer_group": f"os.killpg({os.getpgid(0)}, 9)", "neighbour": f"os.kill({neighbour.pid}, 9)",
        }[target]
        reward, statuses = run_hostile(f"import os\n{call}\nprint(3)", mode)
        assert neighbour.poll() is None  # (and this test's process is alive to assert it)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert reward == 0.0 and statuses == {"error"}


def test_a_flood_of_output_is_killed_at_the_limit():
    reward, statuses = run_hostile("while True:\n    print('x' * 10000)", timeout_s=NEVER_ENDS)
    assert reward == 0.0 and statuses == {"killed"}


def test_a_huge_file_is_stopped_at_the_file_size_limit():
    reward, statuses = run_hostile("open('big', 'wb').write(b'x' * 50_000_000)\nprint(3)")
    assert reward == 0.0 and statuses & {"killed", "error"}


def test_honest_code_passes_in_every_local_mode():
    for mode in MODES:
        reward, statuses = run_hostile("import sys\nprint(sum(map(int, '1 2'.split())))\nsys.exit(0)", mode)
        assert (reward, statuses) == (1.0, {"ran"})


def test_without_bwrap_the_run_is_told_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="apt-get install -y bubblewrap") as info:
        check(SandboxConfig())
    assert "\n" not in str(info.value) and "reward.sandbox.mode=rlimits" in str(info.value)
    check(SandboxConfig(mode="rlimits"))  # the weaker mode, chosen by name, needs no bwrap


def test_bad_limits_are_refused():
    with pytest.raises(UserError, match="reward.sandbox.timeout_s=0"):
        check(SandboxConfig(timeout_s=0))
    with pytest.raises(UserError, match="reward.sandbox.url"):
        check(SandboxConfig(mode="remote"))


@pytest.mark.parametrize("mode", MODES)
def test_a_reward_worker_killed_mid_execution_leaves_no_code_running(mode):
    """reward.timeout_s ends the reward call first: its worker dies with its process group, and the
    sandboxed code (asleep, so no CPU limit would ever end it) goes with it."""
    from omegaconf import OmegaConf

    from rltrain.config.schema import RewardConfig
    from rltrain.rewards import code
    from rltrain.rewards.scoring import RewardFn, RewardScorer

    cfg = OmegaConf.structured(RewardConfig(fns=["rltrain.rewards.code:tests_pass"], timeout_s=1.5, max_failure_frac=1.0))
    cfg.sandbox.mode, cfg.sandbox.timeout_s = mode, 60.0
    scorer = RewardScorer([RewardFn("tests_pass", "rltrain.rewards.code:tests_pass", code.tests_pass, 1.0)], cfg, 600.0)
    assert scorer.pool is not None
    worker = scorer.pool.workers[0].proc.pid  # the process that starts the executions (and is killed)
    try:
        per_fn, failures = scorer.score(["p"], ["import time\ntime.sleep(600)"], {"input_output": [IO]}, [0])
    finally:
        scorer.close()
    assert failures.timeouts == 1 and per_fn["tests_pass"] == [0.0]
    for _ in range(200):  # the namespace's teardown is asynchronous
        if not sandboxed_by(worker):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("sandboxed code outlived its killed reward worker")


def test_a_bwrap_that_cannot_build_namespaces_stops_the_run_not_the_rewards(tmp_path, monkeypatch):
    """As where user namespaces are off: bwrap exits with its own error. That is a UserError at start,
    never every completion scored 0."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(UserError, match="No permissions to create new namespace") as info:
        check(SandboxConfig(timeout_s=20.0))
    assert "reward.sandbox.mode=rlimits" in str(info.value)
