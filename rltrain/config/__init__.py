"""The run's configuration: the schema registered with Hydra (`schema`, `group_options`, `choices`),
every algorithm declared once with what it needs (`algorithms`), what a rank is given to run
(`run_context`), a group's chosen option as its dataclass (`group_choice`) and where a model key's
files are (`hub`). The checks made before a run exists: rltrain/preflight/. Keys: docs/configuration.md.
"""
