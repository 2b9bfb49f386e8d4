"""One training run: the loop (`trainer`) and the protocol it drives (`algorithm`), atomic checkpoints
(`checkpoint`), metrics.jsonl / W&B / console (`metrics_log`), curves (`curves`), sample tables
(`samples`), greedy evaluation (`evaluation`) and the per-rank safety services (`safety_services`).
docs/run-directory.md describes what a run leaves behind.
"""
