"""Multi-turn episodes (`env=python`, `env=tools`, `env=agent`): the loop on the trainer's side
(`episodes`), built from config (`build`); a user environment class (`user_env`, hosted and rebuilt
by replay in workers by `hosted`), typed functions offered as tools (`tools`) or an agent behind an
OpenAI-compatible endpoint (`agent*`); observations as appended token ids (`observations`); the
built-in examples (`addition_with_retries`, `calculator`). docs/environments.md tells the story.
"""
