"""The tests' warm CLI runner (tests/cli.py `run_warm`) behaves as a fresh `python -m rltrain` (or
`python -c ...`, `python script.py ...`):
the same output and exit status, and a cold run wherever the environment would make a difference
(docs/testing.md, "Warm CLI runs"). Every other end-to-end test relies on this."""

from __future__ import annotations

import json
import os
import sys

import pytest
import stand_in
from cli import (
    QUICK,
    SMALL_MODEL,
    SMALL_SFT_RUN_2_RANKS,
    VllmServerChild,
    python,
    rank_server,
    ranks_forked,
    rltrain,
    run_warm,
    train_rows,
)

from rltrain.runtime.parent_death import DIE_WITH_PARENT_ENV

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "args",
    [
        ["--cfg", "job", "algo=grpo", "algo.group_size=3"],  # exits 0 after printing the config
        ["algo=grpo", "algo.loss_agg=tokenmean"],  # a validation error: exit status 2, one paragraph
    ],
)
def test_a_warm_run_prints_and_exits_as_a_cold_one(tiny_cache, tmp_path, args):
    warm = rltrain(*args, run_dir=tmp_path / "warm", check=False, timeout=120)
    cold = rltrain(*args, run_dir=tmp_path / "cold", check=False, timeout=120, warm=False)
    assert warm.returncode == cold.returncode, (warm.stderr, cold.stderr)
    for stream in ("stdout", "stderr"):
        warm_text = getattr(warm, stream).replace(str(tmp_path / "warm"), "RUN_DIR")
        assert warm_text == getattr(cold, stream).replace(str(tmp_path / "cold"), "RUN_DIR"), stream
    assert (tmp_path / "warm").exists() == (tmp_path / "cold").exists()


def test_a_warm_python_command_runs_as_a_fresh_interpreter_would(tmp_path):
    """`python -c ...` and `python script.py ...` (the benchmark scripts' tests) warm: the same
    argv, first sys.path entry, output and exit status as a fresh interpreter."""
    show = "import sys; print(sys.argv, repr(sys.path[0])); sys.exit(3)"
    script = tmp_path / "show.py"
    script.write_text(show)
    expected = {"-c": f"{['-c', 'a', '--b']} ''\n", str(script): f"{[str(script), 'a', '--b']} {str(tmp_path)!r}\n"}
    for first, stdout in expected.items():
        argv = [first, show, "a", "--b"] if first == "-c" else [first, "a", "--b"]
        warm, cold = python(*argv, timeout=120), python(*argv, timeout=120, warm=False)
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr) == (3, stdout, "")
    preloaded = "import sys; print('transformers' in sys.modules)"  # imported by the fork server, not by this code
    assert python("-c", preloaded, timeout=120).stdout == "True\n"
    assert python("-c", preloaded, timeout=120, warm=False).stdout == "False\n"


def test_an_environment_a_preloaded_library_reads_runs_cold(tiny_cache, tmp_path):
    cfg_job = [sys.executable, "-m", "rltrain", "--cfg", "job"]
    env = dict(os.environ, HF_HUB_OFFLINE="0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    assert run_warm(cfg_job, env, timeout=120) is None
    same = run_warm(cfg_job, dict(os.environ, RLTRAIN_X="1"), timeout=120)
    assert same is not None and same.returncode == 0 and "trainer:" in same.stdout
    # PYTHONPATH runs warm: the child's sys.path is the one a fresh interpreter builds from it (the
    # user reward modules of test_rank_errors.py are imported through it).
    with_path = run_warm(cfg_job, dict(os.environ, PYTHONPATH=str(tmp_path)), timeout=120)
    assert with_path is not None and with_path.returncode == 0, with_path


# slow: every multi-rank run in make test goes through warm ranks; a warm run's console and exit equal a cold
# one's in test_a_warm_run_prints_and_exits_as_a_cold_one.
@pytest.mark.slow
def test_warm_ranks_are_forked_from_the_rank_server_and_train_as_cold_ones(tmp_path):
    """The ranks of a warm 2-rank run come from the rank server (tests/rank_server.py) and log the
    numbers of a cold run of the same command (no rank server: its ranks fresh interpreters). The
    shared runs' ranks are forked, so this reference is a run of its own."""
    assert stand_in.RANK_SERVER_ENV not in os.environ
    rltrain(*SMALL_SFT_RUN_2_RANKS, run_dir=tmp_path / "cold", warm=False)
    cold = train_rows(tmp_path / "cold")
    before = ranks_forked()
    rltrain(*SMALL_SFT_RUN_2_RANKS, run_dir=tmp_path / "warm")
    assert ranks_forked() == before + 2
    warm = train_rows(tmp_path / "warm")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in warm] == [(r["step"], r["loss"], r["grad_norm"]) for r in cold]


# slow: every one-rank vLLM run in make test is forked so, and checks its own rollout/trainer parity.
@pytest.mark.slow
def test_a_run_that_builds_its_vllm_engine_is_forked_from_the_vllm_server_and_trains_as_without_it(tiny_cache, tmp_path):
    """A 1-rank GRPO run builds its vLLM engine in its own process: it is forked from the rank
    server's vLLM server (tests/rank_server.py), which has imported vLLM's engine modules, and logs
    the numbers of the same run that imports vLLM itself. That reference differs only in a
    VLLM_LOGGING_LEVEL, which vLLM reads on import: the vLLM server declines it, and it runs from the
    fork server, whose runs print and train as cold ones (the tests above). Ranks of 2-rank runs come
    from the vLLM server too: tests/e2e/test_launch_multinode.py compares them bitwise with ranks
    that import vLLM themselves."""
    args = ["algo=grpo", *QUICK, *SMALL_MODEL, "algo.prompts_per_step=2", "algo.group_size=2", "trainer.max_steps=2",
            "data.num_eval=2"]
    before = ranks_forked(by_vllm_server=True)
    rltrain(*args, run_dir=tmp_path / "itself", env={"VLLM_LOGGING_LEVEL": "WARNING"})
    assert ranks_forked(by_vllm_server=True) == before
    rltrain(*args, run_dir=tmp_path / "forked")
    assert ranks_forked(by_vllm_server=True) == before + 1
    keys = ("step", "loss", "grad_norm", "reward/mean", "rollout/logprob_diff_max", "rollout/response_length_mean")
    itself, forked = train_rows(tmp_path / "itself"), train_rows(tmp_path / "forked")
    assert [[r[k] for k in keys] for r in forked] == [[r[k] for k in keys] for r in itself] and len(itself) == 2
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.update(stand_in.environment(rank_server(), env))
    argv = ["-m", "rltrain", *args, f"hydra.run.dir={tmp_path / 'declined'}"]
    assert VllmServerChild.start(argv, env, sys.path, tmp_path / "out", tmp_path / "err", rank_server()) is None


def test_a_rank_whose_environment_a_preloaded_library_reads_starts_cold(tmp_path):
    """The rank server forks nothing for an environment its libraries were not imported with: it
    answers `cold` and the stand-in trains itself (tests/stand_in.py); with no server at all the
    stand-in goes on at once."""
    import socket

    before = ranks_forked()
    env = dict(os.environ, HF_HUB_OFFLINE="0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    request = {"argv": ["-m", "rltrain.worker", str(tmp_path), str(os.getpid())], "fds": [0, 1, 2], "env": env,
               "cwd": os.getcwd(), "sys_path": sys.path, "parent_named_in": ["argv", 3]}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(rank_server())
        stand_in.send_message(sock, request, [0, 1, 2])
        assert stand_in.LineReader(sock).next() == {"cold": ["HF_HUB_OFFLINE"]}
    assert ranks_forked() == before
    assert stand_in.run_in_server(str(tmp_path / "no-server"), request["argv"], sys.path) is None


# torch's thread count in the main thread and in a thread started after it (ATen applies the count there).
THREADS_SEEN = ("import threading, torch; seen = [torch.get_num_threads()]\n"
                "thread = threading.Thread(target=lambda: seen.append((torch.ones(64, 64) @ torch.ones(64, 64), "
                "torch.get_num_threads())[1]))\nthread.start(); thread.join(); print(seen)")


def test_a_forked_process_takes_torchs_thread_count_from_omp_num_threads_as_a_fresh_one(tmp_path):
    """torchrun's ranks (OMP_NUM_THREADS=1) and a spawned vLLM server set OMP_NUM_THREADS, which
    OpenMP read when the rank server loaded it: the forked process applies it (tests/rank_server.py
    `apply_threads`) and counts what a fresh interpreter with the variable counts. A count above the
    server's own, which a fresh torch caps, starts cold."""
    import socket
    import subprocess

    from cli import ROOT

    above = dict(os.environ, OMP_NUM_THREADS="4096")
    request = {"argv": ["-c", "pass"], "fds": [0, 1, 2], "env": above, "cwd": os.getcwd(), "sys_path": sys.path}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(rank_server())
        stand_in.send_message(sock, request, [0, 1, 2])
        assert stand_in.LineReader(sock).next() == {"cold": ["OMP_NUM_THREADS"]}
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun's
    stand = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import stand_in; "
             f"stand_in.run_in_server({rank_server()!r}, ['-c', {THREADS_SEEN!r}], sys.path[1:])")
    before = ranks_forked()
    forked = subprocess.run([sys.executable, "-c", stand], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ranks_forked() == before + 1, forked.stderr
    cold = subprocess.run([sys.executable, "-c", THREADS_SEEN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert (forked.returncode, forked.stdout) == (cold.returncode, cold.stdout) == (0, "[1, 1]\n"), (forked.stderr, cold.stderr)


def test_the_servers_start_with_the_environment_the_session_began_with(monkeypatch):
    """A module that changed os.environ (vLLM writes LOCAL_WORLD_SIZE and more into it when it
    builds an engine in the test process) does not change the environment a warm process's server
    starts with: a server started then would make every later warm run of the process run cold."""
    from helpers import SESSION_ENV, session_environment

    assert SESSION_ENV and "LOCAL_WORLD_SIZE" not in SESSION_ENV  # recorded by tests/conftest.py
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with session_environment():
        assert dict(os.environ) == SESSION_ENV
    assert os.environ["LOCAL_WORLD_SIZE"] == "1"


def _preloads_missing_and_heap_frozen(rank: int, world_size: int) -> tuple[list[str], bool]:
    import gc

    from helpers import PRELOAD

    return [m for m in PRELOAD if m not in sys.modules], gc.get_freeze_count() > 0


def test_the_fork_server_imports_every_preload_and_freezes_its_heap():
    """Its test modules too (the compiler warm-up, the heap freeze): Python 3.11's fork server skips
    a preload it cannot import without a word, and it drops the sys.path it is handed. (A warm-up
    that left a variable in the server's environment would make every warm run cold: the
    `RLTRAIN_X` case of the test above fails then.)"""
    from helpers import run_ranks

    [(missing, frozen)] = run_ranks(_preloads_missing_and_heap_frozen, nproc=1)
    assert missing == [] and frozen


def _served_once(path, answers: list[dict]) -> tuple[list[dict], list[int]]:
    """A one-connection stand-in server at `path`: the requests read and the descriptors received,
    after sending `answers` in turn (run in a thread)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(60)
        conn, _ = listener.accept()
        with conn:
            data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 8)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 20)
            for answer in answers:
                stand_in.send_message(conn, answer)
    for fd in fds:
        os.close(fd)
    return [json.loads(data)], fds


def test_a_launched_rank_hands_its_command_to_the_rank_server_at_start_up(tmp_path):
    """At interpreter start-up (tests/stand_in_site/sitecustomize.py), a `python -m rltrain.worker`
    under a warm run hands the server its command as a fresh interpreter would run it (the working
    directory first on sys.path), says where the command names its launcher, and exits with the
    forked process's status."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from cli import ROOT

    server = tmp_path / "socket"
    env = dict(os.environ, **stand_in.environment(str(server), dict(os.environ)))
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(_served_once, server, [{"pid": os.getpid()}, {"exit": 3}])
        while not server.exists():
            assert not served.done(), served.result()
        worker = subprocess.run([sys.executable, "-m", "rltrain.worker", str(tmp_path), str(os.getpid())], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=60)
        [request], fds = served.result()
    assert (worker.returncode, worker.stderr) == (3, "")
    fresh = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], cwd=ROOT,
                           env=env, capture_output=True, text=True, check=True)
    assert request["argv"] == ["-m", "rltrain.worker", str(tmp_path), str(os.getpid())]
    assert request["sys_path"] == [str(ROOT), *json.loads(fresh.stdout)]
    assert (request["cwd"], request["fds"], len(fds), request["parent_named_in"]) == (str(ROOT), [0, 1, 2], 3, ["argv", 3])
    assert request["env"][stand_in.RANK_SERVER_ENV] == str(server)


def test_only_a_process_an_rltrain_launcher_starts_is_a_stand_in():
    """The local launcher's ranks, torchrun's ranks, the SFT start's run, a separate rollout
    process and a call pool's worker (user code: rewards, tools, environments, agents); never a
    user's `python -m rltrain` (a cold launcher stays cold) or another program."""
    python = "/usr/bin/python3"
    spec = json.dumps({"control_fd": 7})
    launched = {
        (python, "-u", "-m", "rltrain.worker", "RUN", "12"): ({}, 12, (0, 1, 2), ["argv", 3]),
        (python, "-u", "-m", "rltrain", "a=1"): ({"TORCHELASTIC_RUN_ID": "x"}, os.getppid(), (0, 1, 2), None),
        (python, "-m", "rltrain", "a=1"): ({DIE_WITH_PARENT_ENV: "34"}, 34, (0, 1, 2), ["env", DIE_WITH_PARENT_ENV]),
        (python, "-m", "rltrain.rollout.separate_child", spec): ({}, None, (0, 1, 2, 7), None),
        (python, "-m", "rltrain.runtime.call_worker", "9", "11", "56"): ({}, 56, (0, 1, 2, 9, 11), ["argv", 4]),
    }
    assert stand_in.DIE_WITH_PARENT_ENV == DIE_WITH_PARENT_ENV
    for orig_argv, (environ, dies_with, fds, named_in) in launched.items():
        argv = ["-m", *orig_argv[orig_argv.index("-m") + 2:]]
        assert stand_in.launched_by_rltrain(argv, list(orig_argv), environ) == stand_in.Launched(
            ["-m", orig_argv[orig_argv.index("-m") + 1], *argv[1:]], dies_with, fds, named_in)
    for orig_argv, argv in [((python, "-m", "rltrain", "a=1"), ["-m", "a=1"]), ((python, "-m", "rltrain.plot"), ["-m"]),
                            ((python, "-c", "pass"), ["-c"]), ((python, "x.py"), ["x.py"])]:
        assert stand_in.launched_by_rltrain(argv, list(orig_argv), {}) is None
