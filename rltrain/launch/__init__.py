"""Processes: local ranks on torch's elastic agent (`local`), torchrun ranks agreeing on one run
directory (`shared_run_dir`), a submitit job's tasks as ranks (`submitit_ranks`), and Hydra
sweeps (`sweep`). Ranks start by command line, never by
import, so this package sits low. docs/launching.md.
"""
