"""One training run: the loop (`trainer`), atomic checkpoints (`checkpoint`), metrics.jsonl / W&B /
console (`metrics_log`), curves (`plot`), sample tables (`samples`) and greedy evaluation
(`evaluation`). docs/run-directory.md describes what a run leaves behind.
"""
