"""Multi-turn episodes (`env=python`, `env=tools`): the loop on the trainer's side (`episodes`), built
from config (`build`); a user environment class (`user_env`, hosted and rebuilt by replay in workers by
`hosted`) or typed functions offered as tools (`tools`); observations as appended token ids
(`observations`); a built-in example (`retry`). docs/environments.md tells the story.
"""
