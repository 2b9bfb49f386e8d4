"""Evaluation of an RL run: greedy completions (or episodes) of the held-out prompts.

Sampling is greedy so a step's evaluation depends on the weights only; the rewards are the
training rewards (`reward.fns`, or the environment's return), and a failed reward call scores
`reward.on_failure` uncounted, as in training. With `eval.samples=K` each held-out prompt also gets K
completions at `eval.temperature` (seeded by the step): `eval/pass@k`, `eval/mean@K`, `eval/maj@K`
(rltrain.run.sampled_metrics, docs/evaluation.md). The collector (rltrain/algos/rl/experience.py) owns
the prompts, the engine and the reward functions; docs/environments.md describes the `eval/*` metrics.
"""

from __future__ import annotations

import dataclasses

import torch

from rltrain.algos.rl.experience import ExperienceCollector
from rltrain.algos.rl.task_accuracy import accuracy_per_task, correct_flags, correct_per_task, task_names
from rltrain.data.prompt_data import PromptRow
from rltrain.data.sharding import rank_slice, sum_over_replicas
from rltrain.run.sampled_metrics import PromptSamples, default_ks, metric_keys, metric_sums
from rltrain.run.samples import first_samples


def exact_matches(texts: list[str], rows: list[PromptRow]) -> float:
    """How many texts equal their row's `answer` (stripped): evaluation's `eval/accuracy` count."""
    return float(sum(t.strip() == str(r.columns["answer"]).strip() for t, r in zip(texts, rows, strict=True)))


def evaluate(collector: ExperienceCollector, step: int) -> dict[str, float]:
    """Greedy completions of the held-out prompts: `eval/reward` and, where the data has an
    `answer` column, `eval/accuracy` (exact match; reasoning-gym's verifier, with `eval/accuracy/<task>`)."""
    if not collector.eval_prompts:
        return {}
    mine = rank_slice(collector.eval_prompts, collector.policy.rank, collector.policy.world_size)
    if collector.episodes is not None:
        return evaluate_episodes(collector, mine, step)
    completions = collector.turns.generate([r.ids for r in mine], collector.sampling(step, greedy=True), [r.images or [] for r in mine])
    collector.timeshare.pop_metrics()  # a step's row reports the step's phases only
    per_fn, _ = collector.rewards(mine, completions)  # evaluation's failed samples score reward.on_failure, uncounted
    texts = collector.texts(completions)
    tasks = task_names(collector.eval_prompts)
    correct, per_task = 0.0, [0.0] * len(tasks)
    if mine and "answer" in mine[0].columns:
        flags = correct_flags(texts, mine, per_fn, {rf.name: rf.path for rf in collector.reward_fns})
        correct, per_task = float(sum(flags)), correct_per_task(flags, mine, tasks)
    totals = [sum(rf.weight * per_fn[rf.name][i] for rf in collector.reward_fns) for i in range(len(completions))]
    collector.recorded = first_samples([mine[c.prompt_index].text for c in completions], texts, totals)
    local = torch.tensor([correct, float(sum(totals)), *per_task], dtype=torch.float64, device="cpu")
    sums = sum_over_replicas(local, collector.policy.world_size)
    n = len(collector.eval_prompts)
    out = {"eval/reward": float(sums[1] / n)}
    if "answer" in collector.eval_prompts[0].columns:
        out["eval/accuracy"] = float(sums[0] / n)
        out.update(accuracy_per_task(sums[2:].tolist(), collector.eval_prompts, tasks))
    if collector.ctx.cfg.eval.samples > 0:
        out.update(evaluate_samples(collector, mine, step))
    return out


def evaluate_samples(collector: ExperienceCollector, mine: list[PromptRow], step: int) -> dict[str, float]:
    """K completions per held-out prompt at `eval.temperature`: a sample is correct when it equals the
    row's `answer` (stripped) where the data has one, else when its reward is above 0."""
    cfg = collector.ctx.cfg.eval
    ks = list(cfg.k) if cfg.k is not None else default_ks(cfg.samples)
    greedy = collector.sampling(step, greedy=True)
    settings = dataclasses.replace(greedy, n=cfg.samples, temperature=cfg.temperature, seed=greedy.seed + 104_729)
    completions = collector.turns.generate([r.ids for r in mine], settings, [r.images or [] for r in mine])
    collector.timeshare.pop_metrics()
    per_fn, _ = collector.rewards(mine, completions)
    texts = collector.texts(completions)
    totals = collector.weighted(per_fn, len(completions)).tolist()
    prompts = [PromptSamples([], [], []) for _ in mine]
    for completion, text, reward in zip(completions, texts, totals, strict=True):
        row, prompt = mine[completion.prompt_index], prompts[completion.prompt_index]
        prompt.answers.append(text.strip())
        has_answer = "answer" in row.columns
        prompt.correct.append(text.strip() == str(row.columns["answer"]).strip() if has_answer else reward > 0)
        prompt.rewards.append(reward)
    sums = sum_over_replicas(torch.tensor(metric_sums(prompts, ks), dtype=torch.float64, device="cpu"), collector.policy.world_size)
    n = len(collector.eval_prompts)
    return {key: float(total / n) for key, total in zip(metric_keys(ks, cfg.samples), sums, strict=True)}


def evaluate_episodes(collector: ExperienceCollector, mine: list[PromptRow], step: int) -> dict[str, float]:
    """One greedy episode per held-out prompt: `eval/reward` is their mean reward (the return with
    env=python; reward.fns on the answer with env=tools, plus `eval/accuracy` where the data has an
    `answer` column), `eval/success` the share above 0."""
    assert collector.episodes is not None
    played = collector.turns.play(mine, 1, collector.sampling(step, greedy=True), f"eval-{step}")
    collector.timeshare.pop_metrics()
    scores = played.returns
    correct = 0.0
    if collector.reward_fns:  # env=tools; failed samples score reward.on_failure, uncounted (as single-turn evaluation)
        per_fn, _ = collector.rewards(mine, played.completions, played.final_texts)
        scores = collector.weighted(per_fn, len(played.completions)).tolist()
        if mine and "answer" in mine[0].columns:
            correct = exact_matches(played.final_texts, mine)
    collector.recorded = first_samples([r.text for r in mine], collector.texts(played.completions), scores)
    sums = torch.tensor([float(sum(scores)), float(sum(v > 0 for v in scores)), correct], dtype=torch.float64, device="cpu")
    total = sum_over_replicas(sums, collector.policy.world_size)
    n = len(collector.eval_prompts)
    out = {"eval/reward": float(total[0] / n), "eval/success": float(total[1] / n)}
    if collector.reward_fns and "answer" in collector.eval_prompts[0].columns:
        out["eval/accuracy"] = float(total[2] / n)
    return out

