"""The run's judge from `reward_model=judge`: its settings checked (`check_judge`, also run by the
launcher's preflight), then either the served model (`reward_model.path`) or the endpoint at
`reward_model.url`, with the key read from the variable `reward_model.api_key_env` names.
docs/rewards-and-roles.md, "The LLM judge".
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from rltrain.config.group_options import JudgeRewardModelConfig
from rltrain.config.schema import Config
from rltrain.rewards.judge.endpoint import Endpoint
from rltrain.rewards.judge.judge import LLMJudge
from rltrain.rewards.judge.prompts import compile_template
from rltrain.rewards.judge.served import ServedJudge
from rltrain.runtime.errors import UserError


def check_judge(rm: JudgeRewardModelConfig) -> None:
    """Every judge setting that can be wrong before anything starts, each a one-paragraph UserError."""
    if (rm.path is None) == (rm.url is None):
        raise UserError(
            "reward_model=judge needs exactly one of reward_model.path (a judge model this run serves with vLLM, a "
            "directory or Hub id) and reward_model.url (an OpenAI-compatible endpoint, e.g. http://host:8000/v1, with "
            f"reward_model.model); got path={rm.path!r} and url={rm.url!r}."
        )
    if rm.url is not None and not rm.model:
        raise UserError(f"reward_model.url={rm.url!r} needs reward_model.model: the model name the endpoint serves.")
    if rm.url is not None and not re.match(r"https?://", rm.url):
        raise UserError(f"reward_model.url={rm.url!r} must start with http:// or https:// (e.g. http://host:8000/v1).")
    api_key(rm)
    compile_template(rm.template)
    try:
        groups = re.compile(rm.pattern).groups
    except re.error as exc:
        raise UserError(f"reward_model.pattern={rm.pattern!r} is not a regular expression ({exc}). Fix it.") from exc
    if groups > 1:
        raise UserError(f"reward_model.pattern={rm.pattern!r} has {groups} groups; give at most one, around the number.")
    if not (math.isfinite(rm.max_score) and rm.max_score > 0):
        raise UserError(f"reward_model.max_score={rm.max_score} must be a positive number (the scale's top).")
    if rm.score == "yes_probability" and not rm.yes_token.strip():
        raise UserError("reward_model.score=yes_probability needs reward_model.yes_token, e.g. Yes.")
    if not (rm.timeout_s > 0 and math.isfinite(rm.timeout_s)):
        raise UserError(f"reward_model.timeout_s={rm.timeout_s} must be a positive number of seconds.")
    for key in ("concurrency", "max_tokens", "batch_size", "max_length"):
        if getattr(rm, key) < 1:
            raise UserError(f"reward_model.{key}={getattr(rm, key)} must be at least 1.")
    if rm.retries < 0:
        raise UserError(f"reward_model.retries={rm.retries} must be 0 or more.")


def api_key(rm: JudgeRewardModelConfig) -> str | None:
    """The endpoint's key, from the variable `reward_model.api_key_env` names (never from the config,
    so it is never written to the run's config.yaml or logs)."""
    if rm.api_key_env is None:
        return None
    key = os.environ.get(rm.api_key_env)
    if not key:
        raise UserError(
            f"reward_model.api_key_env={rm.api_key_env!r} names an environment variable that is not set (or is empty). "
            f"Export the endpoint's key as {rm.api_key_env} on every machine of the run, or set reward_model.api_key_env=null "
            "for an endpoint without a key."
        )
    return key


def build_judge(cfg: Config, dtype: str, cuda: bool, run_dir: Path, rank: int) -> LLMJudge:
    """The judge of `cfg.reward_model`; a served one starts loading here and is awaited at its first call."""
    from rltrain.config.hub import local_model_dir

    rm: JudgeRewardModelConfig = cfg.reward_model
    check_judge(rm)
    served = None
    url, model = rm.url, rm.model
    if rm.path is not None:
        directory = local_model_dir("reward_model.path", rm.path, rm.revision)
        served = ServedJudge(directory, rm, dtype, cuda, run_dir / f"judge-server-rank{rank}.log", cfg.trainer.seed,
                             cfg.placement.time_sharing)
        url, model = served.url, served.model_name  # what vLLM serves it as
    assert url is not None and model is not None  # check_judge
    yes = rm.score == "yes_probability"
    endpoint = Endpoint(url, model, rm.api, api_key(rm), 1 if yes else rm.max_tokens, rm.temperature, top_tokens=yes,
                        encode=served.encode if served is not None else None)
    return LLMJudge(rm, endpoint, cfg.reward.max_failure_frac, cfg.safety.collective_timeout_s / 2, served)
