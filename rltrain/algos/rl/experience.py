"""Collecting an RL step's experience: prompts -> completions -> rewards (shared by GRPO and PPO).

`ExperienceCollector.collect(step)` samples `algo.prompts_per_step` prompts (global), has this
rank's engine generate `algo.group_size` completions each or play the episodes
(rltrain/algos/rl/rollout_turns.py), scores them with every reward function (under Megatron tp/pp the
replica's first rank scores and shares) and returns an `Experience`: this rank's sequences in
prompt-major order plus the *global* reward vector every rank agrees on. What happens next
(scoring by the trainer, advantages, losses) belongs to the algorithm (rltrain/algos/rl/algorithm.py);
dynamic sampling's rounds: rltrain/algos/rl/dynamic_sampling.py; evaluation: rltrain/algos/rl/evaluation.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rltrain.algos.rl.batch_layout import BatchLayout
from rltrain.algos.rl.completion_records import recorded_routing, sampled_mask
from rltrain.algos.rl.dynamic_sampling import SamplingRounds, SignalGroups, run_rounds
from rltrain.algos.rl.rollout_turns import RolloutTurns, played_sequences
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.prompt_data import PromptRow, build_prompt_data
from rltrain.data.ragged import Ragged
from rltrain.data.sampler import IndexStream
from rltrain.data.sharding import rank_slice, sum_over_replicas
from rltrain.data.vision_inputs import VisionInputs, vision_extras
from rltrain.data.vision_rows import VisionEncoder
from rltrain.envs.agent.runner import AgentResults, AgentRunner, named_on_every_rank
from rltrain.envs.episodes import EpisodeResults, EpisodeRunner
from rltrain.models.vision import load_processor
from rltrain.rewards.overlong import overlong_penalties
from rltrain.rewards.scoring import Failures, RewardScorer, Scored
from rltrain.rewards.thinking import thinking_tokens
from rltrain.rollout.base import Completion, RolloutEngine, SamplingSettings
from rltrain.rollout.share import leads, raise_leader_error, replica_leader
from rltrain.run.samples import Sample, first_samples
from rltrain.runtime.distributed import share_lists
from rltrain.runtime.errors import UserError
from rltrain.sync.timeshare import TimeSharing


@dataclass
class Experience:
    """One RL step's batch on this rank (prompt-major), and what every rank agrees on globally.
    The trainer-side fields (`old_logps` ... `values`) are filled by the algorithm's scoring;
    None where it does not need them."""

    rows: list[PromptRow]  # this rank's prompts
    completions: list[Completion]  # `group_size` per prompt, in prompt order
    batch: SequenceBatch  # prompt + completion token ids of every completion
    engine_logps: Ragged  # the rollout engine's sampling log-probabilities
    rewards_by_fn: dict[str, list[float]]  # this rank's, per reward function (unweighted)
    reward_failures: Failures  # this rank's samples scored `reward.on_failure` (per function)
    scores_B: torch.Tensor  # this rank's weighted total reward per completion (float64, host)
    global_scores: torch.Tensor  # every rank's totals at their global positions (float64, host)
    counts: torch.Tensor  # global [completion tokens, sequences, truncated sequences, sampled tokens, thinking tokens] (host)
    time_rollout: float
    env_failures: Failures = field(default_factory=Failures)  # failed environment steps or tool calls (env=python, env=tools)
    turns: float = 0.0  # the model's turns over this rank's episodes
    tool_calls: float = 0.0  # the tool calls over this rank's episodes (env=tools)
    env_counts: dict[str, float] = field(default_factory=dict)  # env=agent: `env/<name>` counts over this rank's episodes
    # env=agent: the episode (an index into `scores_B`) of each sequence, where an episode may train
    # several (docs/agents.md); None: sequence i is episode i.
    episode_of: list[int] | None = None
    staleness: int = 0  # policy versions between the sampler and the trainer (placement.max_staleness)
    global_index: list[int] = field(default_factory=list)  # the step's prompts (global, every rank's)
    sampling: SamplingRounds | None = None  # algo.dynamic_sampling: the rounds that made this batch
    old_logps: Ragged | None = None
    entropy: Ragged | None = None
    ref_logps: Ragged | None = None
    values: Ragged | None = None


def sequence_scores(scores_B: torch.Tensor, episode_of: list[int] | None) -> torch.Tensor:
    """Each sequence's reward, its episode's (`Experience.episode_of`)."""
    if episode_of is None:
        return scores_B
    return scores_B[torch.tensor(episode_of, dtype=torch.long, device="cpu")]


def share_scores(
    scored: tuple[dict[str, list[float]], Failures] | None, names: list[str], group
) -> tuple[dict[str, list[float]], Failures]:
    """The replica leader's `scored` (scores per reward function `names`, failures) on every rank
    of `group`, bitwise; the peers pass None."""
    names = list(dict.fromkeys(names))
    ints: list[int] | None = None
    floats: list[float] | None = None
    if scored is not None:
        per_fn, failures = scored
        ints, floats = [failures.timeouts, failures.errors], [v for name in names for v in per_fn[name]]
    got_ints, got_floats = share_lists(ints, floats, replica_leader(group), group)
    if scored is not None:
        return scored
    n = len(got_floats) // len(names) if names else 0
    return {name: got_floats[i * n : (i + 1) * n] for i, name in enumerate(names)}, Failures(got_ints[0], got_ints[1])


class ExperienceCollector:
    """Owns the prompt data, the reward functions and the rollout side of a step."""

    def __init__(
        self, ctx: RunContext, rollout: RolloutEngine, timeshare: TimeSharing, policy, scorer: RewardScorer,
        episodes: EpisodeRunner | AgentRunner | None = None,
    ) -> None:
        cfg = ctx.cfg
        self.ctx, self.algo_cfg = ctx, cfg.algo
        processor = load_processor(ctx.model_dir, ctx.tokenizer)
        self.train_prompts, self.eval_prompts, self.dropped = build_prompt_data(
            ctx.tokenizer, cfg.data, cfg.trainer.seed, episodes.renderer if episodes is not None else None, processor,
        )
        self.images = VisionEncoder(processor) if processor is not None else None  # an episode's own images (rltrain/envs)
        self.scorer = scorer
        self.reward_fns = scorer.fns
        self.stream = IndexStream(len(self.train_prompts), cfg.trainer.seed)
        self.timeshare, self.policy = timeshare, policy
        self.episodes = episodes  # multi-turn episodes: rewarded by the environment (env=python) or reward.fns (env=tools)
        self.turns = RolloutTurns(rollout, timeshare, policy, episodes)
        self.eos = ctx.tokenizer.eos_token_id
        self.layout = BatchLayout(cfg.algo.prompts_per_step, cfg.algo.group_size, policy.rank, policy.world_size)
        self.sample_every = cfg.logger.sample_every
        self.recorded: list[Sample] = []  # W&B sample tables: every logger.sample_every steps and at evaluation

    def sampling(self, step: int, sampling_round: int = 0, greedy: bool = False) -> SamplingSettings:
        """The engine's settings for `step` (and, with dynamic sampling, its round: a new seed each)."""
        a = self.algo_cfg
        return SamplingSettings(
            n=1 if greedy else a.group_size,
            temperature=0.0 if greedy else a.temperature,
            top_p=1.0 if greedy else a.top_p,
            max_new_tokens=a.max_new_tokens,
            seed=self.ctx.cfg.rollout.seed + 1_000_003 * step + 7_919 * sampling_round + self.policy.rank,
            stop_token_ids=[self.eos],
        )

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens kept (a thinking marker may be one)."""
        return self.ctx.tokenizer.decode(token_ids, skip_special_tokens=False)

    def texts(self, completions: list[Completion]) -> list[str]:
        return [self.ctx.tokenizer.decode([t for t in c.token_ids if t != self.eos], skip_special_tokens=True) for c in completions]

    def rewards(
        self, rows: list[PromptRow], completions: list[Completion], texts: list[str] | None = None
    ) -> tuple[dict[str, list[float]], Failures]:
        """Every reward function's scores of `texts` (default: the completions' text). Under
        tensor/pipeline parallelism the replica's leader scores and shares: a reward call that times
        out on one rank and not on another would give the replica's ranks different advantages."""
        group = self.policy.replica_group()
        if group is None:
            return self._score(rows, completions, texts)
        scored, error = None, None
        if leads(group):
            try:
                scored = self._score(rows, completions, texts)
            except UserError as exc:
                error = str(exc)
        raise_leader_error(error, group)
        return share_scores(scored, self.scorer.series_names(), group)

    def _score(
        self, rows: list[PromptRow], completions: list[Completion], texts: list[str] | None
    ) -> tuple[dict[str, list[float]], Failures]:
        owners = [rows[c.prompt_index] for c in completions]
        columns = {key: [r.columns[key] for r in owners] for key in (owners[0].columns if owners else {})}
        groups = [c.prompt_index for c in completions]
        images = [r.images or [] for r in owners] if any(r.images for r in owners) else None  # a vision reward model reads them
        return self.scorer.score(
            [r.text for r in owners], texts if texts is not None else self.texts(completions), columns, groups, images
        )

    def weighted(self, per_fn: dict[str, list[float]], n: int) -> torch.Tensor:
        scores_B = torch.zeros(n, dtype=torch.float64, device="cpu")
        for rf in self.reward_fns:
            scores_B += rf.weight * torch.tensor(per_fn[rf.name], dtype=torch.float64, device="cpu")
        return scores_B

    def take_prompts(self) -> list[int]:
        """The next step's prompts (global indices into the training prompts), from the stream."""
        return self.stream.take(self.algo_cfg.prompts_per_step)

    def my_rows(self, global_index: list[int]) -> list[PromptRow]:
        return [self.train_prompts[i] for i in rank_slice(global_index, self.policy.rank, self.policy.world_size)]

    def collect(self, step: int) -> Experience:
        global_index = self.take_prompts()
        rows = self.my_rows(global_index)
        if self.episodes is not None:
            started = time.perf_counter()
            played = self.turns.play(rows, self.algo_cfg.group_size, self.sampling(step), f"train-{step}")
            time_rollout = time.perf_counter() - started
            return self.assemble_played(step, global_index, played, time_rollout)
        completions = self.turns.generate([r.ids for r in rows], self.sampling(step), [r.images or [] for r in rows])
        if self.algo_cfg.dynamic_sampling:
            return self.collect_signal(step, global_index, rows, completions, self.timeshare.last_generate_s)
        return self.assemble(step, global_index, completions, self.timeshare.last_generate_s)

    def assemble_played(self, step: int, global_index: list[int], played: EpisodeResults, time_rollout: float, staleness: int = 0) -> Experience:
        """The step's `Experience` from its played episodes: an agent's, every sequence it made
        (`Experience.episode_of` names the episode of each)."""
        sequences, episode_of = played_sequences(played)
        exp = self.assemble(step, global_index, sequences, time_rollout, played, staleness=staleness)
        exp.episode_of = episode_of
        return exp

    def collect_signal(
        self, step: int, global_index: list[int], rows: list[PromptRow], completions: list[Completion],
        time_rollout: float, staleness: int = 0, more: Callable[[int], tuple[list[int], list[Completion]]] | None = None,
    ) -> Experience:
        """DAPO's dynamic sampling from a first round (`rows`, `completions`); `run_rounds`
        (rltrain/algos/rl/dynamic_sampling.py) runs the rounds. A short batch is filled with the first
        groups dropped (zero advantage), so its shape never changes. `more(round)` gives round
        `round`'s prompts and completions (default: the next prompts from the stream, sampled now);
        `global_index` becomes every round's prompts. docs/algorithms.md ("Dynamic sampling")."""
        a = self.algo_cfg

        def sample_now(sampling_round: int) -> tuple[list[int], list[Completion]]:
            nonlocal time_rollout
            round_index = self.take_prompts()
            round_rows = self.my_rows(round_index)
            sampled = self.turns.generate([r.ids for r in round_rows], self.sampling(step, sampling_round), [r.images or [] for r in round_rows])
            time_rollout += self.timeshare.last_generate_s
            return round_index, sampled

        picker = SignalGroups(len(rows), a.group_size)
        later, rounds = run_rounds(picker, rows, completions, a.max_sampling_rounds, self.score, self.my_rows, more or sample_now)
        kept_rows, kept_completions, kept_scored = picker.batch()
        exp = self.assemble(
            step, global_index + later, kept_completions, time_rollout, staleness=staleness, rows=kept_rows, scored=kept_scored
        )
        exp.sampling = SamplingRounds(rounds, picker.dropped, picker.filled)
        return exp

    def score(self, rows: list[PromptRow], completions: list[Completion], played: EpisodeResults | None = None) -> Scored:
        """The rewards of `completions` of `rows`: per reward function, the failures and the weighted
        total (with DAPO's overlong term, `reward/overlong`, where `algo.overlong_buffer` is set)."""
        if played is not None:
            if self.reward_fns:  # env=tools: the episode's answer (its last reply) is scored, once per episode
                per_fn, failures = self.rewards(rows, played.completions, played.final_texts)
                scores_B = self.weighted(per_fn, len(played.completions))
            else:
                per_fn, failures = {"env": played.returns}, Failures()
                if isinstance(played, AgentResults):
                    per_fn.update(named_on_every_rank(played))
                scores_B = torch.tensor(played.returns, dtype=torch.float64, device="cpu")
        else:
            per_fn, failures = self.rewards(rows, completions)
            scores_B = self.weighted(per_fn, len(completions))
        a = self.algo_cfg
        if a.overlong_buffer > 0:
            per_fn["overlong"] = overlong_penalties(
                [len(c.token_ids) for c in completions], a.max_new_tokens, a.overlong_buffer, a.overlong_penalty
            )
            scores_B = scores_B + torch.tensor(per_fn["overlong"], dtype=torch.float64, device="cpu")
        return Scored(per_fn, failures, scores_B)

    def assemble(
        self, step: int, global_index: list[int], completions: list[Completion], time_rollout: float,
        played: EpisodeResults | None = None, staleness: int = 0, rows: list[PromptRow] | None = None,
        scored: Scored | None = None,
    ) -> Experience:
        """The step's `Experience` from this rank's completions of the step's prompts (`global_index`):
        rewards, the batch, global counts (a collective: every rank). `played`: the episodes the
        completions come from (env). `rows` and `scored`: this rank's prompts and their rewards where
        the caller picked them (dynamic sampling); else `global_index`'s and scored here."""
        rows = self.my_rows(global_index) if rows is None else rows
        env_failures, episode_counts = Failures(), (0.0, 0.0)
        if played is not None:
            env_failures, episode_counts = played.failures, (played.turns, played.tool_calls)
        env_counts = played.counts if isinstance(played, AgentResults) else {"history_rewrites": float(len(played.extra))} if played else {}
        per_fn, failures, scores_B = scored if scored is not None else self.score(rows, completions, played)
        if self.sample_every and step % self.sample_every == 0:  # (an agent's episodes: the first sequence of each)
            self.recorded = first_samples([rows[c.prompt_index].text for c in completions], self.texts(completions), scores_B.tolist())
        dp_size = self.policy.world_size
        global_scores = torch.zeros(self.layout.global_size, dtype=torch.float64, device="cpu")
        offset = self.layout.offset
        global_scores[offset : offset + len(scores_B)] = scores_B
        global_scores = sum_over_replicas(global_scores, dp_size)
        batch = SequenceBatch.from_lists(
            [c.prompt_ids if c.prompt_ids is not None else rows[c.prompt_index].ids for c in completions], [c.token_ids for c in completions],
            **vision_extras([self.sequence_vision(rows[c.prompt_index], c) for c in completions]),  # each sequence carries its images
        )
        batch.sampled = sampled_mask(completions)
        batch.routing = recorded_routing(completions)
        thinking = sum(thinking_tokens(c.token_ids, self.decode, self.scorer.thinking_end) for c in completions)
        local_counts = torch.tensor(
            [batch.num_completion_tokens, len(completions), sum(not c.finished for c in completions), batch.num_sampled_tokens,
             thinking],
            dtype=torch.float64, device="cpu",
        )
        engine_logps = Ragged.from_lengths(
            torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32, device="cpu"), batch.completion_lens()
        )
        return Experience(
            rows=rows, completions=completions, batch=batch, engine_logps=engine_logps, rewards_by_fn=per_fn,
            reward_failures=failures,
            scores_B=scores_B, global_scores=global_scores, counts=sum_over_replicas(local_counts, dp_size),
            time_rollout=time_rollout, env_failures=env_failures, turns=episode_counts[0], tool_calls=episode_counts[1],
            env_counts=env_counts, staleness=staleness, global_index=global_index,
        )

    def sequence_vision(self, row: PromptRow, completion: Completion) -> VisionInputs | None:
        """A sequence's images for the trainer: its prompt's, or an episode's own (its observations'
        or its agent's images, `Completion.images`)."""
        if completion.images is None:
            return row.vision
        assert self.images is not None or not completion.images, "images reach episodes of vision-language models only"
        return self.images.images_only(completion.images) if self.images is not None else None

    def reward_metrics(self, exp: Experience) -> dict[str, float]:
        """`reward/mean`, `reward/std` and `reward/<fn>` over the global batch; `reward/timeouts` and
        `reward/errors`: its samples (per function) that scored `reward.on_failure` instead."""
        n_global = self.layout.global_size
        failed, env_failed = exp.reward_failures, exp.env_failures
        successes = float((exp.scores_B > 0).sum())
        sums = torch.tensor(
            [sum(v) for v in exp.rewards_by_fn.values()]
            + [successes, exp.tool_calls, float(env_failed.timeouts), float(env_failed.errors), exp.turns]
            + [float(failed.timeouts), float(failed.errors), float((exp.scores_B**2).sum()), float(exp.scores_B.sum())],
            dtype=torch.float64, device="cpu",
        )
        totals = sum_over_replicas(sums, self.policy.world_size)
        means = totals / n_global
        reward_mean = float(means[-1])
        out = {"reward/mean": reward_mean, "reward/std": max(0.0, float(means[-2]) - reward_mean**2) ** 0.5}
        out["reward/timeouts"], out["reward/errors"] = float(totals[-4]), float(totals[-3])
        if self.episodes is not None:
            out["env/timeouts"], out["env/errors"], out["env/turns_mean"] = float(totals[-7]), float(totals[-6]), float(means[-5])
            out["env/tool_calls_mean"], out["env/success"] = float(means[-8]), float(means[-9])
        for i, name in enumerate(exp.rewards_by_fn):  # a reported count (reward/code_timeouts) is summed
            out[f"reward/{name}"] = float(totals[i] if name in self.scorer.counted else means[i])
        if self.episodes is not None:  # env/history_rewrites (and env=agent's env/no_calls): every rank has the same names
            names = sorted(exp.env_counts)
            counted = sum_over_replicas(torch.tensor([exp.env_counts[n] for n in names], dtype=torch.float64, device="cpu"), self.policy.world_size)
            out.update({f"env/{n}": float(v) for n, v in zip(names, counted.tolist(), strict=True)})
        if exp.sampling is not None:  # algo.dynamic_sampling
            dropped, filled = sum_over_replicas(
                torch.tensor([exp.sampling.dropped, exp.sampling.filled], dtype=torch.float64, device="cpu"),
                self.policy.world_size,
            ).tolist()
            out["rollout/sampling_rounds"] = float(exp.sampling.rounds)
            out["rollout/groups_dropped"], out["rollout/groups_without_signal"] = dropped, filled
        return out

    def samples(self) -> list[Sample]:
        """What was recorded since the last call (see `Algorithm.samples`), cleared by the call."""
        taken, self.recorded = self.recorded, []
        return taken
