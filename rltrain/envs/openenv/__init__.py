"""`env=openenv`: an OpenEnv environment (openenv-core) played as an `env=python` episode. `episode`
(the worker's side: one adapter per episode, around a hosted Environment or a server session),
`spaces` (the reply's text as the Action, the observation as the next turn's text), `check` (what
the launcher checks before any rank starts, and what the workers are told). docs/environments.md,
"OpenEnv".
"""
