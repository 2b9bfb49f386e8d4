"""rltrain.rewards.code:tests_pass: where the code is read from, both test layouts (stdin/stdout
cases, asserts with an entry point), the fraction or all-or-nothing reward, its metrics through the
run's scorer (real reward workers, real bubblewrap), and the SandboxFusion client against a stub
service on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf

from rltrain.config.schema import CodeRewardConfig, RewardConfig, SandboxConfig
from rltrain.rewards import code
from rltrain.rewards.code import extract_code, run_tests
from rltrain.rewards.sandbox.settings import SETTINGS_ENV, CodeSettings
from rltrain.rewards.scoring import RewardFn, RewardScorer
from rltrain.rewards.thinking import answer_after_thinking

FAST = SandboxConfig(timeout_s=20.0, cpu_s=20, memory_mb=256, workers=2)  # honest code: a clock a loaded machine never reaches
ADD_IO = {"inputs": ["1 2\n", "3 4\n", "10 -1\n"], "outputs": ["3\n", "7\n", "9\n"]}
ADD = "a, b = map(int, input().split())\nprint(a + b)"
HUMANEVAL_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"
MBPP_TEST = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]


def fenced(code: str, lang: str = "python") -> str:
    return f"Here it is:\n```{lang}\n{code}\n```\nDone."


def test_the_code_is_the_last_fenced_block_after_the_thinking_block():
    assert extract_code("<think>```python\nwrong()\n```</think>\n```py\nfirst()\n```\n```python\nlast()\n```", "</think>") == "last()\n"
    assert extract_code("print(1)", "</think>") == "print(1)"  # no fence: the whole answer
    assert extract_code("<think>still thinking ```python\nx()\n```", "</think>") == ""  # an unclosed block has no answer
    assert answer_after_thinking("<think>a</think>b</think>c", "</think>") == "c"
    assert answer_after_thinking("<think>a", "") == "<think>a"


def test_stdin_stdout_cases_score_the_fraction_passed():
    wrong_on_negatives = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))"
    scored = run_tests(
        [fenced(ADD), fenced(wrong_on_negatives), "print(3)"],
        {"input_output": [ADD_IO, json.dumps(ADD_IO), ADD_IO]}, CodeSettings(sandbox=FAST),
    )
    assert [(s.passed, s.total) for s in scored] == [(3, 3), (2, 3), (1, 3)]


def test_output_is_compared_line_by_line_ignoring_trailing_whitespace():
    io = {"inputs": ["2\n"], "outputs": ["1\n2\n"]}
    settings = CodeSettings(sandbox=FAST)
    spaced, joined = "n = int(input())\nfor i in range(n):\n    print(i + 1, ' ')\nprint()", "print('1 2')"
    assert [s.passed for s in run_tests([spaced, joined], {"input_output": [io, io]}, settings)] == [1, 0]


def test_asserts_run_per_statement_and_humaneval_checks_its_entry_point():
    add, off_by_one = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a + b + (a == 2)"
    columns = {"test": [MBPP_TEST, MBPP_TEST, HUMANEVAL_TEST, HUMANEVAL_TEST], "entry_point": [None, None, "add", "add"]}
    scored = run_tests([fenced(add), fenced(off_by_one), fenced(add), "def add(a, b):\n    return 3"], columns, CodeSettings(sandbox=FAST))
    assert [(s.passed, s.total) for s in scored] == [(3, 3), (2, 3), (1, 1), (0, 1)]


def test_call_based_cases_call_fn_name_with_each_argument_list():
    """APPS / TACO rows with `fn_name`: a module-level function or LeetCode's Solution method."""
    apps = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}  # APPS wraps results in a list
    leetcode = json.dumps({"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9]], "outputs": [[0, 1]]})
    completions = [
        fenced("def add(a, b):\n    return a + b"), "def add(a, b):\n    return 3",
        fenced("class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]"),
        "import sys\nprint(7)\nsys.exit(0)",  # prints a plausible result and leaves before the call
    ]
    scored = run_tests(completions, {"input_output": [apps, apps, leetcode, apps]}, CodeSettings(sandbox=FAST))
    assert [(s.passed, s.total) for s in scored] == [(2, 2), (1, 2), (1, 1), (0, 2)]


def test_exiting_before_the_asserts_is_no_pass():
    for escape in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        scored = run_tests([fenced(escape)], {"test": [MBPP_TEST]}, CodeSettings(sandbox=FAST))[0]
        assert scored.passed == 0 and scored.statuses == {"error"}, escape


def test_all_or_nothing_and_the_call_outside_a_run(monkeypatch):
    completions = [fenced(ADD), "a, b = map(int, input().split())\nprint(a + b if b > 0 else 0)"]
    columns = {"input_output": [ADD_IO, ADD_IO]}
    assert code.tests_pass(["p", "p"], completions, **columns) == [1.0, pytest.approx(2 / 3)]  # the defaults
    settings = CodeSettings(code=CodeRewardConfig(all_or_nothing=True), sandbox=FAST)
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(dataclasses.asdict(settings)))  # as a run hands it to its workers
    assert code.tests_pass(["p", "p"], completions, **columns) == [1.0, 0.0]


def test_a_row_without_tests_is_an_error_naming_the_columns():
    with pytest.raises(ValueError, match="data.columns.input_output=COLUMN"):
        code.tests_pass(["p"], ["print(1)"], solution=["1"])


def test_the_scorer_logs_the_code_metrics_from_its_workers():
    """The run's path: RewardScorer hands reward.sandbox to real reward workers (their environment)
    and collects per-sample metrics beside the rewards."""
    cfg = OmegaConf.structured(RewardConfig(fns=["rltrain.rewards.code:tests_pass"], timeout_s=60.0))
    cfg.sandbox.timeout_s, cfg.sandbox.cpu_s = 4.0, 4  # the loop costs it; the others end long before
    fn = RewardFn("tests_pass", "rltrain.rewards.code:tests_pass", code.tests_pass, 1.0)
    scorer = RewardScorer([fn], cfg, collective_timeout_s=600.0)
    try:
        completions = [fenced(ADD), "print(3)", "while True:\n    pass", "raise ValueError('no')"]
        per_fn, failures = scorer.score(["p"] * 4, completions, {"input_output": [ADD_IO] * 4}, [0, 0, 1, 1])
    finally:
        scorer.close()
    assert per_fn["tests_pass"] == [1.0, pytest.approx(1 / 3), 0.0, 0.0]
    assert per_fn["code_pass_rate"] == per_fn["tests_pass"]
    assert per_fn["code_timeouts"] == [0.0, 0.0, 1.0, 0.0] and per_fn["code_errors"] == [0.0, 0.0, 0.0, 1.0]
    assert per_fn["sandbox_killed"] == [0.0] * 4 and (failures.timeouts, failures.errors) == (0, 0)
    assert scorer.counted == {"code_timeouts", "code_errors", "sandbox_killed"}


class FusionStub(BaseHTTPRequestHandler):
    """SandboxFusion's POST /run_code, run with a plain subprocess (the client is under test)."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FusionStub.requests.append(request)
        if self.path != "/run_code":
            self.send_error(404)
            return
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", request["code"]], input=request["stdin"], capture_output=True,
                                  text=True, timeout=request["run_timeout"])
            run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        reply = {"status": "Success" if run["return_code"] == 0 else "Failed", "message": "", "compile_result": None,
                 "run_result": {**run, "execution_time": 0.1}, "executor_pod_name": None, "files": {}}
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fusion_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FusionStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_the_sandboxfusion_client_runs_both_layouts(fusion_url):
    remote = SandboxConfig(mode="remote", url=fusion_url, timeout_s=20.0, memory_mb=300)
    scored = run_tests(
        [fenced(ADD), "print(3)", fenced("def add(a, b):\n    return a + b"), "import sys\nsys.exit(0)"],
        {"input_output": [ADD_IO, ADD_IO, None, None], "test": [None, None, MBPP_TEST, MBPP_TEST]},
        CodeSettings(sandbox=remote),
    )
    assert [(s.passed, s.total) for s in scored] == [(3, 3), (1, 3), (3, 3), (0, 3)]
    assert scored[3].statuses == {"error"}
    sent = FusionStub.requests[0]
    assert (sent["language"], sent["run_timeout"], sent["memory_limit_MB"]) == ("python", 20.0, 300)
    looping = run_tests(["while True:\n    pass"], {"input_output": [ADD_IO]}, CodeSettings(sandbox=SandboxConfig(
        mode="remote", url=fusion_url, timeout_s=1.0)))[0]
    assert (looping.passed, looping.statuses) == (0, {"timeout"})  # TimeLimitExceeded; its other cases skipped


def test_an_unreachable_sandbox_service_raises_naming_it():
    with socket_closed_port() as port:
        remote = SandboxConfig(mode="remote", url=f"http://127.0.0.1:{port}", timeout_s=1.0)
        with pytest.raises(RuntimeError, match=f"cannot use the sandbox at http://127.0.0.1:{port}/run_code"):
            run_tests(["print(3)"], {"input_output": [ADD_IO]}, CodeSettings(sandbox=remote))


def socket_closed_port():
    import contextlib
    import socket

    @contextlib.contextmanager
    def closed():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield port

    return closed()
