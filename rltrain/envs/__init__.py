"""Multi-turn episodes: the trainer's loop (`episodes`), built from `env` (`build`); a user class in
workers, rebuilt by replay (`user_env`, `hosted`), tools (`tools`), the user's own agent (`agent/`);
observations as token ids (`observations`), a replica's shared episodes (`replica`), built-in
examples (`addition_with_retries`, `calculator`). docs/environments.md, docs/agents.md.
"""
