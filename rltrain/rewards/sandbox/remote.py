"""Executions on a SandboxFusion service (`reward.sandbox.mode=remote reward.sandbox.url=...`).

Each execution is one `POST {url}/run_code` of SandboxFusion's documented API (`code`, `language`,
`stdin`, `run_timeout`, `memory_limit_MB` in; `status` and `run_result` with `status`,
`return_code`, `stdout`, `stderr` out). The code sent is our launcher, so the end-of-program nonce
works as locally; the service applies its own isolation and limits. An unreachable service or a
`SandboxError` raises: a failed call, counted, never a silent zero.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from rltrain.config.schema import SandboxConfig
from rltrain.rewards.sandbox.base import Execution, Outcome, finished, new_nonce, payload
from rltrain.rewards.sandbox.local import launcher_source

HTTP_SLACK_S = 30.0  # the request's own timeout beyond the execution's: queueing on the service


class RemoteSandbox:
    def __init__(self, cfg: SandboxConfig) -> None:
        if not cfg.url:
            raise ValueError("reward.sandbox.mode=remote needs reward.sandbox.url=http://HOST:PORT (a SandboxFusion service).")
        self.cfg, self.url = cfg, cfg.url.rstrip("/") + "/run_code"
        self.launcher = launcher_source()

    def run(self, execution: Execution) -> Outcome:
        nonce = new_nonce()
        request = {
            "code": self.launcher,
            "language": "python",
            "stdin": payload(execution, nonce, {}, None, ".").decode(),
            "run_timeout": self.cfg.timeout_s,
            "compile_timeout": self.cfg.timeout_s,
            "memory_limit_MB": self.cfg.memory_mb,
        }
        reply = self.post(request)
        run = reply.get("run_result") or {}
        if reply.get("status") == "SandboxError" or not run:
            raise RuntimeError(f"the sandbox at {self.url} could not run the code: {reply.get('message') or reply!r:.300}")
        if run.get("status") == "TimeLimitExceeded":
            return Outcome("timeout", run.get("stdout") or "", f"past run_timeout={self.cfg.timeout_s:g} s on {self.url}")
        stdout, stderr = (run.get("stdout") or "").encode(), (run.get("stderr") or "").encode()
        code = run.get("return_code")
        if code is None:  # it ended without an exit status: the service stopped it
            return Outcome("killed", stdout.decode(errors="replace"), f"stopped by the service: {run.get('status')}")
        return finished(stdout, stderr, nonce, -code if code < 0 else None, max(code, 0))

    def post(self, request: dict) -> dict:
        data = json.dumps(request).encode()
        http = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(http, timeout=self.cfg.timeout_s + HTTP_SLACK_S) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RuntimeError(f"cannot use the sandbox at {self.url} (reward.sandbox.url): {exc}") from None
