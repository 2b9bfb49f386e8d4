"""The run's configuration: the schema registered with Hydra (`schema`, `group_options`, `choices`),
what a rank is given to run (`run_context`), where a model key's files are (`hub`), the checks made
before anything is built (`validate`, `validate_rl`, `sources`, `layout`), and composition errors as
one line (`compose_errors`). docs/configuration.md lists every key.
"""
