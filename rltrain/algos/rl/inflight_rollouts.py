"""Batches from an engine that takes new weights between its decoding steps (`placement.weight_update=in_flight`).

The rollout process runs vLLM step by step (rltrain/rollout/inflight_child.py): the trainer asks for
step t's batch as soon as it holds step t - 1's, with the prompts of steps up to t + 2 + 2k (more than
the engine can start before the trainer's next version, so it never waits for prompts), and publishes
each new version as usual (`update_weights`, loaded between two decode steps
while the requests in flight go on). Without `placement.stream` step t's batch is its own prompts,
admitted once version t - 1 - k is loaded; with it, the first `algo.prompts_per_step` groups to
complete, their tokens older than the bound allows masked out of training (partial rollouts). Every token
carries the version that sampled it. docs/async.md, "Weights in flight".
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from rltrain.algos.rl.experience import Experience, ExperienceCollector
from rltrain.config.schema import PlacementConfig
from rltrain.rollout.base import Completion
from rltrain.rollout.control_wire import routing_from_json
from rltrain.rollout.inflight_schedule import oldest_trained_version, version_stats
from rltrain.runtime.errors import UserError


class StreamingEngine(Protocol):
    def request(self, op: str, **fields: Any) -> Any:
        """One request to the rollout process, its result (rltrain/rollout/separate.py)."""

    def post(self, op: str, **fields: Any) -> int:
        """Send a request whose result `reply` waits for later; other requests may go meanwhile."""

    def reply(self, request_id: int) -> Any:
        """The result of a posted request."""


class InFlightRollouts:
    """The trainer's side of the in-flight mode (see the module doc)."""

    def __init__(
        self, collector: ExperienceCollector, engine: StreamingEngine, placement: PlacementConfig, max_steps: int,
        eval_versions: list[int],
    ) -> None:
        self.collector, self.engine, self.placement = collector, engine, placement
        self.k, self.max_steps, self.eval_versions = placement.max_staleness, max_steps, eval_versions
        self.per_step = collector.algo_cfg.prompts_per_step
        self.opened = False
        self.submitted_through = 0  # the last step whose prompts the engine has
        self.untrained: list[int] = []  # prompts submitted and not trained yet, in submission order
        self.restored: list[list[int]] = []  # a checkpoint's untrained prompts, a step's worth each
        # Since the stream opened: the tokens of the batches taken, the engine's busy seconds.
        self.taken_tokens, self.busy_s = 0.0, 0.0
        self.posted: tuple[int, int] | None = None  # (step, request id) of the batch asked for ahead

    def _open(self, step: int) -> None:
        a = self.collector.algo_cfg
        sampling = self.collector.sampling(step)
        options = {
            "stream": self.placement.stream, "deterministic": self.placement.deterministic, "max_staleness": self.k,
            "per_step": self.per_step, "group_size": a.group_size, "lag_steps": self.placement.update_lag_steps,
            "version": step - 1, "first_step": step, "expected_groups": self.per_step * (self.max_steps - step + 1),
            "eval_versions": self.eval_versions,
            "sampling": {
                "temperature": sampling.temperature, "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens,
                "stop_token_ids": sampling.stop_token_ids,
            },
        }
        self.engine.request("stream_open", options=options)
        self.opened, self.submitted_through = True, step - 1

    def _prompts_through(self, last: int) -> list[dict[str, Any]]:
        """The prompts of the steps up to `last` not yet handed to the engine (the data stream's, in
        step order). They travel with the next `take`: one round trip per step, not two."""
        groups: list[dict[str, Any]] = []
        for step in range(self.submitted_through + 1, min(last, self.max_steps) + 1):
            index = self.restored.pop(0) if self.restored else self.collector.take_prompts()
            self.untrained += index
            seed = self.collector.sampling(step).seed
            for position, (i, row) in enumerate(zip(index, self.collector.my_rows(index), strict=True)):
                if row.images:
                    raise UserError(
                        "placement.weight_update=in_flight submits token ids only, and this data's prompts carry images "
                        "(docs/vision.md). Set placement.weight_update=between_batches (generating ahead carries images)."
                    )
                groups.append({
                    "index": i, "step": step, "position": position, "prompt_ids": row.ids,
                    "seed": seed,
                })
            self.submitted_through = step
        return groups

    def _post_take(self, step: int) -> None:
        """Ask for step `step`'s batch now, its prompts and those ahead with it; the answer is read
        by `next_experience(step)`. Asked one step early, the engine answers the moment the batch is
        complete rather than between two of its decoding steps after the trainer asks."""
        groups_ahead = self._prompts_through(step + 2 + 2 * self.k)
        self.posted = (step, self.engine.post("take", step=step, groups=groups_ahead))

    def next_experience(self, step: int) -> tuple[Experience, dict[str, float]]:
        """Step `step`'s experience and its metrics (waits, versions, idle share, regenerated groups)."""
        if not self.opened:
            self._open(step)
        if self.posted is None:
            self._post_take(step)
        assert self.posted is not None and self.posted[0] == step, (self.posted, step)
        started = time.perf_counter()
        taken = self.engine.reply(self.posted[1])
        wait_s = time.perf_counter() - started
        self.posted = None
        if step < self.max_steps:
            self._post_take(step + 1)  # before training on this one: see `_post_take`
        groups = taken["groups"]
        for g in groups:
            self.untrained.remove(int(g["index"]))
        completions, versions, masked = partial_rollouts(groups, oldest_trained=oldest_trained_version(step, self.k))
        stats = version_stats(versions)
        oldest = int(stats["rollout/token_version_min"]) if any(versions) else step - 1
        tokens = [step - 1 - v for seq in versions for v in seq]
        busy, idle = float(taken["busy_s"]), float(taken["idle_s"])
        exp = self.collector.assemble(step, [int(g["index"]) for g in groups], completions, busy, staleness=step - 1 - oldest)
        return exp, {
            "rollout/tokens_per_s": self._tokens_per_busy_s(float(exp.counts[0]), busy),
            **stats,
            "rollout/staleness_mean": sum(tokens) / max(len(tokens), 1),
            "rollout/staleness_max": float(step - 1 - oldest),
            "rollout/engine_idle_frac": idle / max(idle + busy, 1e-9),
            "rollout/regenerated": float(taken["dropped"]),
            "rollout/stale_tokens_masked": float(masked),
            "time/wait_rollout": wait_s,
        }

    def _tokens_per_busy_s(self, tokens: float, busy_s: float) -> float:
        """`rollout/tokens_per_s`: the batches' tokens over the engine's busy seconds, both summed
        since the stream opened. A batch is sampled across several takes' windows (the engine works
        ahead), so one window's busy time can be a sliver of its batch's; the sums cover the same
        work but the groups in flight and the regenerated ones (docs/async.md, "Weights in flight")."""
        self.taken_tokens += tokens
        self.busy_s += busy_s
        return self.taken_tokens / self.busy_s if self.busy_s > 0 else 0.0

    # --- checkpoint part (rltrain/run/checkpoint.py; the file generating ahead writes and reads) --

    def save_checkpoint(self, directory: Path) -> None:
        """The prompts submitted and not trained, a step's worth per row as `AsyncRollouts` writes
        them with nothing generated: a resumed run (in flight or between batches) generates them
        first, from the checkpoint's weights, so no prompt of the stream is skipped."""
        step = self.submitted_through - len(self.untrained) // self.per_step
        rows = [
            {"step": step + 1 + i, "global_index": self.untrained[i * self.per_step : (i + 1) * self.per_step],
             "version": max(0, step - self.k + i), "completions": None, "generate_s": 0.0}
            for i in range(len(self.untrained) // self.per_step)
        ]
        (directory / "rank0.json").write_text(json.dumps({"max_staleness": self.k, "pending": rows}))

    def load_checkpoint(self, directory: Path) -> None:
        rows = json.loads((directory / "rank0.json").read_text())["pending"]
        self.restored = [[int(i) for i in row["global_index"]] for row in sorted(rows, key=lambda r: int(r["step"]))]


def partial_rollouts(groups: list[dict[str, Any]], oldest_trained: int) -> tuple[list[Completion], list[list[int]], int]:
    """A batch's completions with every token sampled before version `oldest_trained` masked out of
    training (`Completion.sampled` False, log-probability 0: context, as an environment's
    observation is): a group that completed holding such a token is trained from where the bound
    allows rather than generated again (docs/async.md, "The per-token bound"). Also the versions
    of the trained tokens, per sequence, and the count of masked tokens. Each sample's routing
    record (router replay, rltrain/rollout/inflight_routing.py) covers every token, masked or not."""
    completions: list[Completion] = []
    trained: list[list[int]] = []
    masked = 0
    for position, g in enumerate(groups):
        routing = g.get("routing") or [None] * len(g["token_ids"])
        for tokens, logps, vs, finished, experts in zip(
            g["token_ids"], g["logprobs"], g["versions"], g["finished"], routing, strict=True
        ):
            keep = [int(v) >= oldest_trained for v in vs]
            masked += keep.count(False)
            completions.append(Completion(
                position, [int(t) for t in tokens], [float(x) if k else 0.0 for x, k in zip(logps, keep, strict=True)],
                bool(finished), None if all(keep) else keep, routing=routing_from_json(experts),
            ))
            trained.append([int(v) for v, k in zip(vs, keep, strict=True) if k])
    return completions, trained, masked


def evaluated_versions(eval_every: int, max_steps: int) -> list[int]:
    """The versions an evaluation follows (rltrain/run/trainer.py: every `eval_every` steps and after
    the last): a deterministic engine runs each evaluation right after loading its version."""
    every = [s for s in range(eval_every, max_steps + 1, eval_every)] if eval_every > 0 else []
    return sorted({*every, max_steps})
