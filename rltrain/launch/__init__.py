"""Processes: local ranks on torch's elastic agent (`local`), a rank dying with its launcher
(`parent_death`), torchrun ranks agreeing on one run directory (`shared_run_dir`), and Hydra sweeps
(`sweep`). docs/launching.md tells the story.
"""
