"""Every enum-like key is checked at composition, with the allowed values named.

The allowed values are declared once, as `Literal`s in rltrain/config/schema.py,
rltrain/config/group_options.py and each algorithm's module (rltrain/algos/<name>.py, rl/config.py); `CHOICES` (validate) and the constants of the code that reads each
key are derived from them. These tests keep them equal and find every enum-like key of the schema in CHOICES, so a new one cannot be added without its check. The CLI side (one paragraph, exit 2) is
tests/e2e/test_bad_input_cli.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from helpers import compose_config

from rltrain.algos.rl import config as rl_config
from rltrain.config import group_options, schema
from rltrain.config.algorithms import ALGORITHMS
from rltrain.config.choices import choices_of
from rltrain.preflight.validate import CHOICES, validate
from rltrain.runtime.errors import UserError

# The group (and, for algorithm- or engine-specific keys, the option) each schema class belongs to.
SCHEMA_PREFIX = {
    "TrainerConfig": "trainer",
    "OptimConfig": "optim",
    "ModelConfig": "model",
    "DataConfig": "data",
    "WandbConfig": "logger.wandb",
    "SandboxConfig": "reward.sandbox",
    "DPOConfig": "algo",
    "GRPOConfig": "algo",
    "VLLMRolloutConfig": "rollout",
    "ServersConfig": "rollout.servers",
    "SafetyConfig": "safety",
    "HealthConfig": "health",
    "SweepConfig": "sweep",
    "PlacementConfig": "placement",
    "RLConfig": "algo",
    "JudgeRewardModelConfig": "reward_model",
    **{spec.config.__name__: "algo" for spec in ALGORITHMS.values()},
}
# The group option a key exists under; others use the default composition (algo=grpo, rollout=vllm).
OPTION_OF = {"algo.loss": "algo=dpo", "rollout.servers.push_backend": "rollout=server",
             "reward_model.api": "reward_model=judge", "reward_model.score": "reward_model=judge"}


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def tiny_model_dir():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(ModelConfig(), seed=0)


def _cfg(*overrides: str):
    return compose_config(*overrides)


def test_choices_mirror_the_code_that_reads_them():
    from rltrain.algos.advantages import SCALES
    from rltrain.algos.dpo import DPO_LOSSES
    from rltrain.algos.policy_loss import IMPORTANCE_LEVELS, LOSS_AGGS, POLICY_LOSSES
    from rltrain.data.tasks import TASKS
    from rltrain.launch.sweep import DIRECTIONS
    from rltrain.rollout import PROCESSES
    from rltrain.rollout.server.push import PUSH_BACKENDS
    from rltrain.runtime.precision import PRECISIONS

    assert CHOICES["trainer.precision"] == PRECISIONS
    assert CHOICES["algo.loss"] == DPO_LOSSES
    assert CHOICES["algo.loss_agg"] == LOSS_AGGS
    assert CHOICES["algo.policy_loss"] == POLICY_LOSSES  # the keys of the surrogates' table
    assert CHOICES["algo.importance_level"] == IMPORTANCE_LEVELS
    assert CHOICES["algo.scale_rewards"] == SCALES
    assert CHOICES["rollout.process"] == PROCESSES
    assert CHOICES["rollout.servers.push_backend"] == PUSH_BACKENDS
    assert CHOICES["sweep.direction"] == DIRECTIONS
    assert set(CHOICES["data.task"]) == set(TASKS)


def test_every_enum_like_key_of_every_group_is_checked():
    """Every `choice()` field of every schema class is in CHOICES under its group, and no `str`
    field lists its values in a comment (`# a | b | c`) instead of a Literal."""
    found = set()
    classes = [
        (name, cls)
        for module in (schema, group_options, rl_config, *{inspect.getmodule(s.config) for s in ALGORITHMS.values()})
        for name, cls in inspect.getmembers(module, dataclasses.is_dataclass)
        if cls.__module__ == module.__name__
    ]
    assert {name for name, _ in classes} >= {"TrainerConfig", "RLConfig", "VLLMRolloutConfig"}
    for cls_name, cls in classes:
        choices = choices_of(cls)
        if choices:
            assert cls_name in SCHEMA_PREFIX, f"{cls_name} has enum-like keys but no group prefix here"
        found |= {f"{SCHEMA_PREFIX[cls_name]}.{name}" for name in choices}
        body = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            line = re.search(rf"^\s+{f.name}: str = .*$", body, re.M)
            assert not (line and re.search(r"#.* \| ", line.group(0))), f"{cls_name}.{f.name}: declare its values as a Literal"
    assert found == set(CHOICES), f"enum-like keys without a check: {sorted(found - set(CHOICES))}"


def test_the_defaults_of_every_algorithm_and_backend_pass():
    teacher = f"teacher.path={tiny_model_dir()}"
    for algo, spec in ALGORITHMS.items():
        for backend in ("fsdp", "megatron"):
            validate(_cfg(f"algo={algo}", f"backend={backend}", *([teacher] if spec.teacher else [])))
    validate(_cfg("rollout=hf"))


def test_a_reward_model_runs_on_megatron_and_with_lora_but_not_both():
    validate(_cfg("algo=rm", "backend=megatron", "backend.tp=2", "trainer.nproc=2"))
    validate(_cfg("algo=rm", "model.lora.rank=8"))
    with pytest.raises(UserError, match="model.lora.rank=8 with backend=megatron.*FSDP backend only"):
        validate(_cfg("algo=rm", "backend=megatron", "model.lora.rank=8"))
    with pytest.raises(UserError, match="algo.center_rewards_coefficient=-1.0 must be at least 0"):
        validate(_cfg("algo=rm", "algo.center_rewards_coefficient=-1"))


def test_kto_weights_and_temperature_are_checked():
    with pytest.raises(UserError, match="algo.beta=0.0 must be positive"):
        validate(_cfg("algo=kto", "algo.beta=0"))
    with pytest.raises(UserError, match="algo.desirable_weight=-1.0 and algo.undesirable_weight=1.0 must be at least 0"):
        validate(_cfg("algo=kto", "algo.desirable_weight=-1"))
    with pytest.raises(UserError, match="not both 0"):
        validate(_cfg("algo=kto", "algo.desirable_weight=0", "algo.undesirable_weight=0"))
    validate(_cfg("algo=kto", "algo.desirable_weight=0"))  # undesirable examples alone still train


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_bad_value_names_the_key_and_every_allowed_value(key):
    option = [OPTION_OF[key]] if key in OPTION_OF else []
    cfg = _cfg(*option, f"{key}=tokenmean")
    with pytest.raises(UserError) as info:
        validate(cfg)
    message = str(info.value)
    assert f"{key}='tokenmean'" in message
    assert all(str(v) in message for v in CHOICES[key]), message


def test_a_key_of_another_algorithm_is_not_checked_where_it_does_not_exist():
    cfg = _cfg("algo=sft")
    assert "loss_agg" not in cfg.algo and "loss" not in cfg.algo
    validate(cfg)


@pytest.mark.parametrize(
    "override, names",
    [
        ("model.num_heads=3", "model.hidden_size=128"),
        ("model.num_kv_heads=3", "model.num_kv_heads=3"),
        ("model.attention_bias=false", "model.arch=llama"),
        ("data.num_eval=0", "data.num_eval=0"),
        ("data.eval_seed=-1", "data.eval_seed=-1"),
        ("data.eval_fraction=1.5", "data.eval_fraction=1.5"),
        ("data.max_carry_problems=-1", "data.max_carry_problems=-1"),
        ("model.sft_carry_problems=-5", "model.sft_carry_problems=-5"),
        ("data.forgotten_carries=1.5", "data.forgotten_carries=1.5"),
        ("model.sft_forgotten_carries=-0.1", "model.sft_forgotten_carries=-0.1"),
        ("data.same_length_rejected=1.5", "data.same_length_rejected=1.5"),
        ("data.forgotten_carries=0.5 data.task=multiplication", "only data.task=addition"),
        ("data.max_carry_problems=0 data.task=multiplication", "Set data.max_carry_problems=null "),
        ("algo=sft data.task=colours", "data.task=colours is a visual task"),  # the text-only tiny model
        ("algo=dpo model=tiny data.task=code", "data.task='code' has no preference pairs"),
        ("algo=kto model=tiny data.task=code data.num_eval=200", "use it with algo=sft, grpo or ppo"),
        ("algo.group_size=0", "algo.group_size=0"),
        ("algo.top_p=0", "algo.top_p=0"),
        ("sweep.last_n=0", "sweep.last_n=0"),
        ("logger.sample_every=-1", "logger.sample_every=-1"),
        ("rollout.num_threads=-1", "rollout.num_threads=-1"),
    ],
)
def test_unusable_values_are_refused_naming_the_key(override, names):
    with pytest.raises(UserError, match=re.escape(names)):
        validate(_cfg(*override.split()))


def test_every_carry_key_of_the_sft_start_is_named_in_one_message_on_another_task():
    with pytest.raises(UserError) as refused:
        validate(_cfg("algo=grpo", "data.task=multiplication"))
    message = str(refused.value)
    assert "model.sft_carry_problems=1000, model.sft_forgotten_carries=0.8" in message
    assert "Set model.sft_carry_problems=null model.sft_forgotten_carries=0." in message
    validate(_cfg("algo=grpo", "data.task=multiplication", "model=tiny"))  # no SFT start: nothing to refuse


def test_the_visual_recipe_and_the_visual_task_on_a_vision_language_model_pass():
    validate(_cfg("+experiment=grpo_vision"))
    validate(_cfg("algo=sft", "model=tiny_vl", "data.task=colours"))
    validate(_cfg("algo=dpo", "model=tiny_vl", "data.task=colours", "trainer.max_steps=2"))  # pairs: another colour rejected
    validate(_cfg("algo=kto", "model=tiny_vl", "data.task=colours", "trainer.max_steps=2"))


def test_dpo_values_are_refused_naming_the_key():
    with pytest.raises(UserError, match=r"algo\.label_smoothing=0\.5"):
        validate(_cfg("algo=dpo", "algo.label_smoothing=0.5"))
    with pytest.raises(UserError, match=r"algo\.beta=0"):
        validate(_cfg("algo=dpo", "algo.beta=0"))


def test_compile_without_a_cpp_compiler_is_refused_before_building(monkeypatch):
    """`backend.compile=true` needs the C++ compiler inductor uses ($CXX, else g++)."""
    cfg = compose_config("backend=fsdp", "backend.compile=true")
    validate(cfg)  # g++ is installed here
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(UserError, match=r"backend.compile=true needs a C\+\+ compiler.*no-such-compiler-xyz"):
        validate(cfg)
    validate(compose_config("backend=fsdp"))  # off: no compiler needed


def test_a_batch_smaller_than_the_ranks_is_refused_where_the_algorithm_reads_it():
    for algo in ("sft", "dpo"):
        with pytest.raises(UserError, match=r"trainer\.global_batch_size=1 is smaller than the 2"):
            validate(_cfg(f"algo={algo}", "trainer.nproc=2", "trainer.global_batch_size=1"))
    validate(_cfg("algo=grpo", "trainer.nproc=2", "trainer.global_batch_size=1"))  # RL steps are algo.prompts_per_step


@pytest.mark.parametrize(
    "overrides, names",
    [
        (("algo=sft", "env=python", "env.cls=m:C"), "env=python trains with algo=grpo or algo=ppo; algo=sft cannot"),
        (("algo=dpo", "env=tools", "env.tools=[m:f]"), "env=tools trains with algo=grpo or algo=ppo; algo=dpo cannot"),
        (("env=tools",), "env=tools needs env.tools=[package.module:function,...]"),
        (("env=tools", "env.tools=[no_colon]"), "env.tools entry 'no_colon' must be package.module:function"),
        (("env=tools", "env.tools=[m:f]", "env.cls=m:C"), "env.cls='m:C' is set but env=tools does not use it"),
        (("env.tools=[m:f]",), "env.tools=['m:f'] is set but env=none does not use it"),
    ],
)
def test_multi_turn_configurations_this_release_cannot_run_are_refused(overrides, names):
    with pytest.raises(UserError, match=re.escape(names)):
        validate(_cfg(*overrides))


def test_ppo_and_grpo_run_with_either_env():
    for algo in ("grpo", "ppo"):
        validate(_cfg(f"algo={algo}", "env=python", "env.cls=m:C"))
        validate(_cfg(f"algo={algo}", "env=tools", "env.tools=[m:f]", "reward.fns=[m:r]"))


ASYNC = ("placement.max_staleness=1", "rollout=vllm", "rollout.process=separate")


@pytest.mark.parametrize(
    "overrides, names",
    [
        (("placement.max_staleness=-1",), "placement.max_staleness=-1 must be 0 (synchronous)"),
        (("algo=sft", "placement.max_staleness=1"), "algo=sft generates nothing"),
        ((*ASYNC, "placement.time_sharing=true"), "take turns on one device, so nothing can overlap. Set placement.time_sharing=false"),
        (("placement.max_staleness=2", "rollout=hf"), "needs an engine that runs beside the trainer: rollout=vllm rollout.process=separate"),
        (("placement.max_staleness=1", "rollout=vllm", "rollout.process=colocated"), "rollout=vllm rollout.process=colocated shares the trainer's process"),
    ],
)
def test_generating_ahead_where_nothing_can_overlap_is_refused(overrides, names):
    with pytest.raises(UserError, match=re.escape(names)):
        validate(_cfg(*overrides))


def test_generating_ahead_runs_with_grpo_and_ppo_on_both_backends():
    for algo in ("grpo", "ppo"):
        for backend in ("fsdp", "megatron"):
            validate(_cfg(f"algo={algo}", f"backend={backend}", *ASYNC))
    validate(_cfg(*ASYNC, "env=python", "env.cls=m:C"))  # multi-turn: a batch's episodes are played whole, ahead
    validate(_cfg(*ASYNC, "env=agent", "env.agent=m:run"))  # agents too: the endpoint is served from the engine's worker


@pytest.mark.parametrize(
    "overrides, names",
    [
        (("algo=distill",), "algo=distill needs teacher.path"),
        (("algo=grpo", "teacher.path=TINY"), "is set but algo=grpo has no teacher (algo=distill distils from one)"),
        (("algo=distill", "algo.beta=0.1", "teacher.path=TINY"), "algo.beta=0.1: algo=distill builds no reference"),
        (("algo.dynamic_sampling=true", "algo.group_size=1"), "a group of one completion never has rewards that differ"),
        (("algo.dynamic_sampling=true", "env=python", "env.cls=m:C"), "algo.dynamic_sampling=true with env=python"),
        (("algo.overlong_buffer=4", "env=python", "env.cls=m:C"), "algo.overlong_buffer=4 with env=python"),
        (("algo.overlong_buffer=6",), "algo.overlong_buffer=6 must be in [0, algo.max_new_tokens=6)"),
        (("algo=ppo", "algo.max_sampling_rounds=0"), "algo.max_sampling_rounds=0 must be at least 1"),
    ],
)
def test_the_named_objectives_refuse_what_they_cannot_run(overrides, names):
    overrides = tuple(o.replace("TINY", str(tiny_model_dir())) for o in overrides)
    with pytest.raises(UserError, match=re.escape(names)):
        validate(_cfg(*overrides))
