"""`env=agent`, the trainer's side: the user's agents play their episodes in call workers while this
thread serves their requests with the rollout engine.

Each episode is one call of the pool (rltrain/envs/agent/episode.py:run_episode) with its own key at
the endpoint (rltrain/envs/agent/endpoint.py). While the pool runs them (a thread of its own), the
thread that owns the engine takes the queued requests in batches, renders their messages with the
chat template, samples them in one engine call per distinct sampling setting and answers each; every
token served is recorded (rltrain/envs/agent/record.py). An episode trains on every sequence it made,
with what its agent returned; one that timed out, raised, returned no number or never called the
endpoint scores `reward.on_failure`. docs/agents.md tells the story (images: docs/vision.md).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rltrain.config.group_options import EnvConfig
from rltrain.config.schema import RewardConfig
from rltrain.data.prompt_data import PromptRow
from rltrain.envs.agent.endpoint import AgentEndpoint, ApiError, Pending
from rltrain.envs.agent.record import Chain, Continuation, EpisodeRecord
from rltrain.envs.agent.reply import choice, completion_body, cut_reply, render
from rltrain.envs.episodes import (
    TURN_SEED_STRIDE,
    EpisodeResults,
    Generate,
    results_from_json,
    results_to_json,
)
from rltrain.envs.images import agent_row
from rltrain.envs.observations import ObservationRenderer
from rltrain.rewards.scoring import Failures
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.server.images import message_images
from rltrain.runtime.call_pool import Call, CallPool, CallResult
from rltrain.runtime.distributed import broadcast_str
from rltrain.runtime.errors import UserError

RUN_EPISODE = "rltrain.envs.agent.episode:run_episode"
GATHER_S = 0.02  # after a request arrives, how long the engine waits for others to batch with it
POLL_S = 0.05


@dataclass
class AgentResults(EpisodeResults):
    """`completions` holds each episode's sequence of its last reply; `extra` the sequences its
    history rewrites and `n` > 1 forks left behind, `extra_episode` whose each one is (an index into
    the episodes): they train with their episode's reward and advantage (docs/agents.md)."""

    named: dict[str, list[float]] = field(default_factory=dict)  # the agents' named rewards (reward/<name>), per episode
    counts: dict[str, float] = field(default_factory=dict)  # env/history_rewrites, env/no_calls: summed over episodes


def played_to_json(played: EpisodeResults) -> dict[str, Any]:
    """A played batch as plain data (an asynchronous run's checkpoint, docs/async.md): an agent
    batch keeps every sequence its episodes made, the episode of each and its named rewards."""
    row = results_to_json(played)
    if isinstance(played, AgentResults):
        row["agent"] = {"named": played.named, "counts": played.counts}
    return row


def played_from_json(row: dict[str, Any]) -> EpisodeResults:
    played = results_from_json(row)
    if "agent" not in row:
        return played
    agent = row["agent"]
    return AgentResults(
        played.completions, played.returns, played.final_texts, played.failures, played.turns, played.tool_calls,
        named={str(k): [float(x) for x in v] for k, v in agent["named"].items()},
        counts={str(k): float(v) for k, v in agent["counts"].items()},
        extra=played.extra, extra_episode=played.extra_episode,
    )


def chat_template_text(value: str | None) -> str | None:
    """`env.chat_template`: a Jinja template, or the path of a file holding one (`.jinja`)."""
    if value is None or "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(f"env.chat_template={value!r} is neither a Jinja template nor a file: give the template or its path.")
    return path.read_text()


def named_on_every_rank(results: AgentResults) -> dict[str, list[float]]:
    """The named rewards under the names any rank's agents returned (0.0 where an episode gave none),
    so every rank logs the same `reward/<name>` keys (a collective: every rank of the run)."""
    names = sorted(results.named)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every = set(names)
        for rank in range(dist.get_world_size()):
            every.update(json.loads(broadcast_str(json.dumps(names) if rank == dist.get_rank() else None, src=rank)))
        names = sorted(every)
    size = len(results.returns)
    return {name: results.named.get(name, [0.0] * size) for name in names}


class AgentRunner:
    """Plays a step's agent episodes for one rank: `run(rows, copies, sampling, phase, generate)` as
    rltrain/envs/episodes.py's EpisodeRunner, with `generate` the engine's call on this rank alone."""

    renderer = None  # prompts are the agents' own messages

    def __init__(
        self, env_cfg: EnvConfig, reward_cfg: RewardConfig, tokenizer: Any, max_new_tokens: int, max_prompt_tokens: int,
        collective_timeout_s: float, start_workers: bool = True, observations: ObservationRenderer | None = None,
    ) -> None:
        if not env_cfg.agent or ":" not in env_cfg.agent:
            raise UserError(f"env=agent needs env.agent=package.module:function, your agent (got {env_cfg.agent!r}).")
        self.cfg, self.reward_cfg, self.tokenizer = env_cfg, reward_cfg, tokenizer
        vision = observations if observations is not None else ObservationRenderer(tokenizer)
        self.encoder, self.image_token = vision.encoder, vision.image_token_id  # a vision-language model's (None: text-only)
        self.turn_tokens = env_cfg.max_tokens_per_turn or max_new_tokens
        self.max_context = max_prompt_tokens + env_cfg.max_total_tokens  # a call's prompt ids at most
        self.timeout_s = float(env_cfg.timeout_s) if env_cfg.timeout_s else None
        self.budget_s = collective_timeout_s / 2  # a step's episodes, all together (as EpisodeRunner)
        self.pool = CallPool(env_cfg.workers, [RUN_EPISODE, env_cfg.agent], "agent", env_cfg.max_concurrency)
        if start_workers:
            self.pool.start()
        self.chat_template = chat_template_text(env_cfg.chat_template)
        self.endpoint: AgentEndpoint | None = None
        self.batches = 0  # engine calls so far in this phase: each samples with its own seed

    def run(self, rows: list[PromptRow], copies: int, sampling: SamplingSettings, phase: str, generate: Generate) -> AgentResults:
        """`copies` episodes per row, prompt-major; `phase` names the step (as EpisodeRunner's)."""
        if self.endpoint is None:
            self.endpoint = AgentEndpoint(self.timeout_s)
        endpoint = self.endpoint
        self.batches = 0  # a phase's seeds depend on its own calls only: a resumed run samples as the uninterrupted one
        owners = [i for i in range(len(rows)) for _ in range(copies)]
        deadline = time.monotonic() + self.budget_s
        keys = endpoint.open_phase(len(owners), deadline)
        records = [self._record() for _ in owners]
        agent_rows = [agent_row(row) for row in rows]
        calls = [
            Call(RUN_EPISODE, {
                "agent": self.cfg.agent, "base_url": endpoint.base_url(key), "api_key": key, "row": agent_rows[i],
                "timeout_s": self.timeout_s,
            })
            for i, key in zip(owners, keys, strict=True)
        ]
        outcome: dict[str, Any] = {}

        def play() -> None:
            try:
                outcome["results"] = self.pool.run(calls, self.timeout_s, deadline)
            except BaseException as exc:  # noqa: BLE001 - raised again on the engine's thread
                outcome["error"] = exc

        player = threading.Thread(target=play, name=f"agents-{phase}", daemon=True)
        player.start()
        try:
            while player.is_alive():
                batch = endpoint.take(POLL_S, GATHER_S)
                if batch:
                    self._serve(batch, records, sampling, generate)
        finally:
            endpoint.close_phase()
            player.join()
        if "error" in outcome:
            raise outcome["error"]
        return self._results(rows, owners, records, outcome["results"], sampling)

    def _record(self, attempt: int = 1) -> EpisodeRecord:
        return EpisodeRecord(self.tokenizer, attempt, self.encoder, self.image_token)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        self.pool.close()

    # --- serving -------------------------------------------------------------------------------

    def _serve(self, batch: list[Pending], records: list[EpisodeRecord], sampling: SamplingSettings, generate: Generate) -> None:
        """Answer every request of `batch`: one engine call per distinct sampling setting."""
        assert self.endpoint is not None
        groups: dict[tuple[float, float, int, int], list[tuple[Pending, Continuation]]] = {}
        for p in batch:
            try:
                refusal = self.endpoint.refusal(p.episode, p.attempt)
                if refusal is not None:
                    raise refusal
                if records[p.episode].attempt != p.attempt:  # played again: what the lost attempt was served goes
                    records[p.episode] = self._record(p.attempt)
                at = records[p.episode].continuation(*self._rendered(p))
                if len(at.prompt_ids) > self.max_context:
                    raise ApiError(
                        400, f"the conversation is {len(at.prompt_ids)} tokens; this run serves at most {self.max_context} "
                        "(data.max_length + env.max_total_tokens)",
                    )
            except ApiError as exc:
                p.answer(exc.status, exc.body())
                continue
            groups.setdefault(self._settings(p, sampling), []).append((p, at))
        answered: set[int] = set()
        try:
            for (temperature, top_p, max_new, n), items in groups.items():
                settings = SamplingSettings(
                    n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new,
                    seed=sampling.seed + TURN_SEED_STRIDE * self.batches, stop_token_ids=list(sampling.stop_token_ids),
                )
                self.batches += 1
                completions = generate([at.prompt_ids for _, at in items], settings, [at.images for _, at in items])
                for j, (p, at) in enumerate(items):
                    self._answer(p, at, completions[j * n : (j + 1) * n], records[p.episode], sampling.stop_token_ids)
                    answered.add(id(p))
        finally:  # an engine failure: no agent waits for an answer that will not come
            for items in groups.values():
                for p, _ in items:
                    if id(p) not in answered:
                        p.answer(500, ApiError(500, "the rollout engine failed").body())

    def _rendered(self, p: Pending) -> tuple[str, list]:
        """A request's messages as the model reads them, and their images (ApiError 400: an image
        that is no data URL of a PNG, JPEG or WEBP, or a template that does not mark each image once)."""
        sees = self.encoder is not None
        text = render(self.tokenizer, p.request.messages, p.request.tools, self.chat_template, sees)
        if not sees:
            return text, []
        assert self.encoder is not None
        try:
            images = [image.convert("RGB") for image in message_images(p.request.messages)]
        except ValueError as exc:
            raise ApiError(400, f"{exc}; send images inline as base64 data URLs (remote URLs are not fetched)") from None
        marks = text.count(self.encoder.processor.image_token)
        if marks != len(images):
            raise ApiError(
                400, f"the messages hold {len(images)} image(s) but their rendering has {marks} image placeholder(s): "
                "the chat template must write one per image_url part (and message text must not write the image token)",
            )
        return text, images

    def _settings(self, p: Pending, sampling: SamplingSettings) -> tuple[float, float, int, int]:
        """(temperature, top_p, max new tokens, n) for a request: the agent's, within the run's
        per-turn budget; greedy in evaluation; the run's sampling where the agent sets none."""
        r = p.request
        greedy = sampling.temperature == 0.0
        temperature = 0.0 if greedy else (r.temperature if r.temperature is not None else sampling.temperature)
        top_p = 1.0 if greedy else (r.top_p if r.top_p is not None else sampling.top_p)
        return temperature, top_p, min(r.max_tokens or self.turn_tokens, self.turn_tokens), r.n

    def _answer(self, p: Pending, at: Continuation, completions: list[Completion], record: EpisodeRecord, stop_ids: list[int]) -> None:
        replies = [cut_reply(self.tokenizer, c.token_ids, c.logprobs, c.finished, stop_ids, p.request.stop) for c in completions]
        record.record(at, [(r.ids, r.logprobs, r.finished) for r in replies], completions[0].version if completions else None)
        call_id = f"chatcmpl-{p.episode}-{record.calls}"
        tools = p.request.tools if p.request.use_tools else None
        choices = [choice(self.tokenizer, r, k, tools, f"call_{p.episode}_{record.calls}_{k}") for k, r in enumerate(replies)]
        record.tool_calls += sum(len(c["message"].get("tool_calls") or []) for c in choices[:1])
        p.answer(200, completion_body(call_id, choices, len(at.prompt_ids), sum(len(r.ids) for r in replies)))

    # --- the step's results ----------------------------------------------------------------------

    def _results(
        self, rows: list[PromptRow], owners: list[int], records: list[EpisodeRecord], results: list[CallResult], sampling: SamplingSettings,
    ) -> AgentResults:
        completions: list[Completion] = []
        extra: list[Completion] = []
        extra_episode: list[int] = []
        returns: list[float] = []
        finals: list[str] = []
        named_rows: list[dict[str, float]] = []
        failures = Failures()
        failed = no_calls = 0
        first_error = ""
        for episode, (i, record, result) in enumerate(zip(owners, records, results, strict=True)):
            chain = record.trained()
            for k, left in enumerate(record.chains):
                if k != record.last_chain:
                    extra.append(_completion(i, left))
                    extra_episode.append(episode)
            value = result.value if result.failure is None and isinstance(result.value, dict) else None
            if value is None or chain is None:
                failed += 1
                if result.failure == "timeout":
                    failures.timeouts += 1
                else:
                    failures.errors += 1
                    no_calls += value is not None  # it returned, but never asked the model anything
                    first_error = first_error or (result.message if value is None else "")
                returns.append(float(self.reward_cfg.on_failure))
                named_rows.append({})
            else:
                returns.append(float(value["reward"]))
                named_rows.append(value["named"])
            if chain is None:  # one stop token after the row's prompt, not sampled: no gradient, the batch's layout kept
                completions.append(Completion(i, list(sampling.stop_token_ids[:1]), [0.0], True, [False]))
                finals.append("")
            else:
                completions.append(_completion(i, chain))
                finals.append(self.tokenizer.decode([t for t, s in zip(chain.tokens, chain.sampled, strict=True) if s], skip_special_tokens=True))
        if failed > self.reward_cfg.max_failure_frac * len(owners):
            raise UserError(
                f"the agent {self.cfg.agent!r} failed on {failed} of this rank's {len(owners)} episodes ({failures.timeouts} timed out "
                f"after env.timeout_s={self.timeout_s}, {no_calls} never called the endpoint, the rest raised or returned no reward), "
                f"more than reward.max_failure_frac={self.reward_cfg.max_failure_frac:g}. Fix it, or raise env.timeout_s or "
                f"reward.max_failure_frac.{f' The first error: {first_error[:500]}' if first_error else ''}"
            )
        names = sorted({name for named in named_rows for name in named})
        return AgentResults(
            completions, returns, finals, failures, float(sum(r.calls for r in records)), float(sum(r.tool_calls for r in records)),
            named={name: [named.get(name, 0.0) for named in named_rows] for name in names},
            counts={"history_rewrites": float(sum(r.rewrites for r in records)), "no_calls": float(no_calls)},
            extra=extra, extra_episode=extra_episode,
        )


def _completion(prompt_index: int, chain: Chain) -> Completion:
    return Completion(
        prompt_index, list(chain.tokens), list(chain.logprobs), chain.finished, list(chain.sampled), list(chain.prompt_ids), chain.version,
        list(chain.images),
    )
