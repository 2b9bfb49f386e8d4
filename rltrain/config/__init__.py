"""The run's configuration: the schema registered with Hydra (`schema`, the run's sections and root;
`group_options`, the options a group chooses between; `choices`, their enum-like fields), the checks
made before anything is built (`validate`, `layout`), composition errors as one line
(`compose_errors`) and the `--help` page (`command_help`). docs/configuration.md lists every key.
"""
