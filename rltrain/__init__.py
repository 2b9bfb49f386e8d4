"""rltrain: post-training of language models (SFT, preference, RL, distillation) composed from Hydra config.

Entry points: `python -m rltrain` (`__main__`), one spawned rank (`worker`), `python -m rltrain.plot`,
`python -m rltrain.serve`, `python -m rltrain.eval`.
Packages, from the bottom layer up: `runtime` (a rank's process groups, dtypes, errors), `safety`,
`config` (the schema), `launch` (processes), `models`, `data`, `transport`, `backends`, `rollout`,
`sync`, `rewards`, `envs`, `run` (the loop and its outputs), `algos`, and `preflight` (the checks
and help before a run exists). docs/architecture.md walks one GRPO step through them.
"""

from rltrain.runtime.torchvision_compat import make_torchvision_importable

make_torchvision_importable()  # vision-language models need it; the CPU venv keeps it aside (docs/vision.md)
