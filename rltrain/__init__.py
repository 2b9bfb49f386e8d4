"""rltrain: post-training of language models (SFT, DPO, GRPO, PPO) composed from Hydra config.

Entry points: `python -m rltrain` (`__main__`), one spawned rank (`worker`), `python -m rltrain.plot`.
Packages: `config` (schema, checks), `launch` (processes), `runtime` (a rank's process groups,
dtypes, errors), `run` (the loop and its outputs), `algos`, `backends`, `rollout`, `sync`, `safety`,
`data`, `models`, `rewards`. docs/architecture.md walks one GRPO step through them.
"""

from rltrain.runtime.torchvision_compat import make_torchvision_importable

make_torchvision_importable()  # vision-language models need it; the CPU venv keeps it aside (docs/vision.md)
