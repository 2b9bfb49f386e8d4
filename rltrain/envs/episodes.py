"""Multi-turn episodes on the trainer's side: one token sequence per episode, token in, token out.

Each turn the engine samples every live episode's reply from its ids so far (one engine call); the
replies go to the other side, `EpisodeSteps` (a user environment's `step`, or the tools a reply
calls), whose observations are tokenized and appended. An episode ends when that side says `done`,
after `env.max_turns` replies, or when `env.max_total_tokens` is spent. Its `Completion` holds exactly
the ids the engine saw and sampled, `sampled` marking the model's tokens: only those get policy
gradient (docs/environments.md). A reply the chat template re-renders once followed (Qwen3 drops
its thinking) is seen so next turn and trains as sampled in an extra sequence (`Episode.observe`).
Images (the prompt's, then the observations') go to the engine and the trainer (docs/vision.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rltrain.config.group_options import EnvConfig
from rltrain.config.schema import RewardConfig
from rltrain.data.prompt_data import PromptRenderer, PromptRow
from rltrain.envs.images import environment_row
from rltrain.envs.observations import Observation
from rltrain.envs.wire import to_wire
from rltrain.rewards.scoring import Failures
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.control_wire import completions_from_json, completions_to_json
from rltrain.rollout.images import PromptImages
from rltrain.runtime.errors import UserError

TURN_SEED_STRIDE = 100_003  # each turn samples with its own seed
# The engine's call: prompts' ids, the sampling, each prompt's images.
Generate = Callable[[list[list[int]], SamplingSettings, list[PromptImages]], list[Completion]]


@dataclass
class Episode:
    prompt_index: int
    key: str  # "phase:index", unique within the phase (rltrain/envs/hosted.py)
    row: dict[str, Any]
    context: list[int]  # the prompt's ids, then `tokens`
    chat: bool = False  # the prompt was chat messages, rendered by the chat template
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # the model's replies, decoded
    reward: float = 0.0
    done: bool = False  # no more turns
    waiting: bool = False  # not its turn (a two-player game's other seat moves): no reply sampled this turn
    ended_by_env: bool = False  # the environment said done / the reply called no tool (else max_turns or the token budget)
    failure: str | None = None  # "timeout" or "error": the episode scores reward.on_failure
    timeouts: int = 0  # user calls of this episode that ran out of time (a reset/step, or a tool call)
    errors: int = 0  # ... that raised or returned nonsense
    tool_calls: int = 0
    images: list = field(default_factory=list)  # the images in `context`, in placeholder order (the prompt's first)
    seen_images: bool = False  # an observation brought images: the sequence's images are not its row's
    reply_at: int = 0  # where in `tokens` the last reply starts
    # Each reply the chat template rewrote: the sequence up to it as sampled, only that reply trained.
    rewritten: list[Completion] = field(default_factory=list)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        if logprobs is not None:
            self.reply_at = len(self.tokens)
        self.tokens += ids
        self.context += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.sampled += [logprobs is not None] * len(ids)

    def open_reply(self) -> str | None:
        """The last reply where the episode's ids end with it (what a chat template may re-render
        once an observation follows it: rltrain.envs.observations.rewritten_reply)."""
        return self.actions[-1] if self.actions and self.reply_at < len(self.tokens) and self.sampled[-1] else None

    def observe(self, observation: Observation, room: int, image_token: int | None) -> None:
        """Append an observation, cut to `room` tokens (never through an image's visual tokens). One
        that rewrites the last reply (the chat template's rendering of it and the messages after it)
        replaces that reply, whose sequence as sampled is kept in `rewritten`."""
        ids, images = observation.ids, observation.images
        if observation.rewrites_reply:
            self.rewritten.append(self.last_reply_sequence())
            cut = len(self.tokens) - self.reply_at
            del self.tokens[self.reply_at :], self.logprobs[self.reply_at :], self.sampled[self.reply_at :], self.context[len(self.context) - cut :]
            room += cut
        if len(ids) > room:
            ids, images = cut_observation(ids, images, room, image_token)
        self.append(ids, None)
        self.images += images
        self.seen_images = self.seen_images or bool(images)

    def completion(self) -> Completion:
        return Completion(
            self.prompt_index, list(self.tokens), list(self.logprobs), self.ended_by_env, list(self.sampled), images=self._images()
        )

    def last_reply_sequence(self) -> Completion:
        """Its sequence so far, only the last reply trained (the sampled tokens before it train in
        the episode's own sequence, which keeps them), with the images its ids hold so far."""
        at = self.reply_at
        return Completion(
            self.prompt_index, list(self.tokens), [0.0] * at + self.logprobs[at:], True, [False] * at + self.sampled[at:],
            images=self._images(),
        )

    def _images(self) -> list | None:
        """The images of its ids so far where an observation brought some (None: the row's)."""
        return list(self.images) if self.seen_images else None


def cut_observation(ids: list[int], images: list, room: int, image_token: int | None) -> tuple[list[int], list]:
    """An observation's first `room` ids and the images left whole in them: a cut inside an image's
    run of visual tokens moves back to the run's start."""
    end = room
    if image_token is not None:
        while 0 < end < len(ids) and ids[end] == image_token and ids[end - 1] == image_token:
            end -= 1
    kept = ids[:end]
    if image_token is None:
        return kept, []
    runs = sum(1 for i, t in enumerate(kept) if t == image_token and (i == 0 or kept[i - 1] != image_token))
    return kept, images[:runs]


def before_placeholder(ids: list[int], logprobs: list[float], image_token: int | None) -> tuple[list[int], list[float]]:
    """A reply up to the image placeholder token, where it sampled one: the engine would read it as
    an image's slot in the next turn. A prefix of a sample is a sample."""
    if image_token is None or image_token not in ids:
        return ids, logprobs
    at = ids.index(image_token)
    return ids[:at], logprobs[:at]


class EpisodeSteps(Protocol):
    """The side of an episode that answers the model: reset it, then answer each reply by appending
    an observation (`Episode.append(ids, None)`), adding reward, or ending it (`done`)."""

    def reset(self, episodes: list[Episode], deadline: float) -> None:
        """Start each episode (its first observation), within `deadline`."""

    def step(self, episodes: list[Episode], deadline: float) -> None:
        """Answer each episode's last reply (an observation, reward, or its end), within `deadline`."""

    def check(self, episodes: list[Episode]) -> None:
        """Raise a UserError when too many of a phase's episodes failed to go on."""

    def close(self) -> None:
        """Stop the workers that answer the episodes."""


@dataclass
class EpisodeResults:
    completions: list[Completion]  # one per episode, prompt-major
    returns: list[float]  # the sum of each episode's step rewards (reward.on_failure for a failed one)
    final_texts: list[str]  # each episode's last reply (what env=tools scores with reward.fns)
    failures: Failures  # user calls that failed: a reset or step (the episode ends), or a tool call
    turns: float  # the model's turns, summed over episodes
    tool_calls: float  # tool calls, summed over episodes
    # Sequences beyond one per episode, and the episode (an index into `completions`) of each: replies
    # the chat template rewrote, trained where they were sampled; env=agent's history rewrites and
    # forks. Each trains with its episode's reward and advantage.
    extra: list[Completion] = field(default_factory=list)
    extra_episode: list[int] = field(default_factory=list)

    def sequences(self) -> tuple[list[Completion], list[int]]:
        """Every sequence to train, and the episode of each."""
        return self.completions + self.extra, list(range(len(self.completions))) + self.extra_episode


def results_to_json(played: EpisodeResults) -> dict[str, Any]:
    """A played batch as plain data (an asynchronous run's checkpoint holds the batches in flight)."""
    return {
        "completions": completions_to_json(played.completions), "returns": played.returns, "final_texts": played.final_texts,
        "failures": [played.failures.timeouts, played.failures.errors], "turns": played.turns, "tool_calls": played.tool_calls,
        "extra": completions_to_json(played.extra), "extra_episode": played.extra_episode,
    }


def results_from_json(row: dict[str, Any]) -> EpisodeResults:
    return EpisodeResults(
        completions_from_json(row["completions"]), [float(r) for r in row["returns"]], [str(t) for t in row["final_texts"]],
        Failures(int(row["failures"][0]), int(row["failures"][1])), float(row["turns"]), float(row["tool_calls"]),
        completions_from_json(row.get("extra", [])), [int(i) for i in row.get("extra_episode", [])],
    )


class EpisodeRunner:
    """Runs the episodes of a step for one rank: `generate(prompts, sampling)` is the collector's
    engine call (every rank of a replica calls it together), `steps` the environment's side."""

    def __init__(
        self, env_cfg: EnvConfig, reward_cfg: RewardConfig, tokenizer, max_new_tokens: int, collective_timeout_s: float, steps: EpisodeSteps,
        renderer: PromptRenderer | None = None, image_token: int | None = None,
    ) -> None:
        self.cfg, self.reward_cfg, self.tokenizer, self.steps = env_cfg, reward_cfg, tokenizer, steps
        self.renderer = renderer  # how prompts are rendered (env=tools: with the tools offered)
        self.image_token = image_token  # a vision-language model's placeholder (None: text-only)
        self.turn_tokens = env_cfg.max_tokens_per_turn or max_new_tokens
        self.budget_s = collective_timeout_s / 2  # a step's environment calls, all turns together

    def run(
        self, rows: list[PromptRow], copies: int, sampling: SamplingSettings, phase: str,
        generate: Generate,
    ) -> EpisodeResults:
        """`copies` episodes per row (GRPO's group), prompt-major. `phase` names the step (e.g.
        "train-12"): the workers drop the episodes of an earlier phase."""
        wired = [to_wire(environment_row(row)) for row in rows]  # what reset(**row) gets, ready for the pipe
        episodes = [
            Episode(i, f"{phase}:{i * copies + k}", wired[i], list(row.ids), row.chat, images=list(row.images or []))
            for i, row in enumerate(rows)
            for k in range(copies)
        ]
        # One deadline for every call of the phase: however many turns hang, a peer never waits
        # into the collective timeout.
        deadline = time.monotonic() + self.budget_s
        self.steps.reset(episodes, deadline)
        turns, turn = 0, 0
        while True:  # each turn samples a reply of every live episode; at most env.max_turns per episode
            live = [
                e for e in episodes
                if not e.done and not e.waiting and len(e.actions) < self.cfg.max_turns and len(e.tokens) < self.cfg.max_total_tokens
            ]
            if not live:
                break
            most_room = max(self.cfg.max_total_tokens - len(e.tokens) for e in live)
            turn_sampling = replace(
                sampling, n=1, max_new_tokens=min(self.turn_tokens, most_room), seed=sampling.seed + TURN_SEED_STRIDE * turn
            )
            replies = generate([e.context for e in live], turn_sampling, [list(e.images) for e in live])
            for e, reply in zip(live, replies, strict=True):
                room = self.cfg.max_total_tokens - len(e.tokens)
                ids, logprobs = before_placeholder(reply.token_ids[:room], reply.logprobs[:room], self.image_token)
                e.append(ids, logprobs)  # a prefix of what was sampled
                e.actions.append(self._text(ids, sampling.stop_token_ids))
            turns += len(live)
            turn += 1
            self.steps.step(live, deadline)
        for e in episodes:
            if e.failure is not None:
                e.reward = float(self.reward_cfg.on_failure)
            if not e.tokens:  # its reset failed: one stop token, not sampled (no gradient), keeps the batch's layout
                e.append(sampling.stop_token_ids[:1], None)
        self.steps.check(episodes)
        return EpisodeResults(
            [e.completion() for e in episodes], [e.reward for e in episodes], [e.actions[-1] if e.actions else "" for e in episodes],
            Failures(sum(e.timeouts for e in episodes), sum(e.errors for e in episodes)), float(turns),
            float(sum(e.tool_calls for e in episodes)),
            [c for e in episodes for c in e.rewritten], [i for i, e in enumerate(episodes) for _ in e.rewritten],
        )

    def _text(self, ids: list[int], stop_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in stop_ids], skip_special_tokens=True)

    def close(self) -> None:
        self.steps.close()


def check_failed_episodes(episodes: list[Episode], what: str, timeout_s: float | None, max_failure_frac: float, fix: str) -> None:
    """An environment that fails more of a rank's episodes than `reward.max_failure_frac` stops the
    run in one paragraph (below it, each failure costs its own episode: docs/environments.md)."""
    failed = [e for e in episodes if e.failure is not None]
    if len(failed) > max_failure_frac * len(episodes):
        timeouts = sum(e.failure == "timeout" for e in failed)
        raise UserError(
            f"{what} failed on {len(failed)} of this rank's {len(episodes)} episodes "
            f"({timeouts} timed out after env.timeout_s={timeout_s}, {len(failed) - timeouts} raised), more than "
            f"reward.max_failure_frac={max_failure_frac:g}. {fix}"
        )
