"""One training run: the loop (`trainer`) and the protocol it drives (`algorithm`), atomic checkpoints
(`checkpoint`), metrics.jsonl / W&B / console (`metrics_log`), curves (`plot`), sample tables
(`samples`) and greedy evaluation (`evaluation`). docs/run-directory.md describes what a run leaves behind.
"""
