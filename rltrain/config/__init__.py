"""The run's configuration: the schema registered with Hydra (`schema`, `group_options`, `choices`),
every algorithm declared once with what it needs (`algorithms`), what a rank is given to run
(`run_context`), where a model key's files are (`hub`), the checks made before anything is built
(`validate`, `validate_rl`, `validate_inflight`, `sources`, `layout`), composition errors as one line (`compose_errors`)
and the `--help` page (`command_help`). docs/configuration.md lists every key.
"""
