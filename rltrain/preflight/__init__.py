"""What runs before a run exists: the checks of a composed config (`validate`, with `validate_roles`,
`validate_rl`, `validate_inflight`), where its models and data come from (`sources`), the world a run
will have and megatron's split of it (`world`), Hydra's composition errors as one line
(`compose_errors`), Hydra's run mode read without a second composition (`hydra_mode`) and the
`--help` page (`command_help`). It sits above every package it checks.
"""
