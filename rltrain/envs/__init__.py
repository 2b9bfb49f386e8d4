"""Multi-turn environments (`env=python`): the episode loop on the trainer's side (`episodes`),
the worker side that hosts the user's environment objects and rebuilds them by replay (`hosted`),
observations as token ids appended to an episode (`observations`) and a built-in example
(`retry`). docs/environments.md tells the story.
"""
