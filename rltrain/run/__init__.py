"""One training run: the loop (`trainer`) and the protocol it drives (`algorithm`), atomic checkpoints
(`checkpoint`), metrics.jsonl / console (`metrics_log`) and the trackers (`trackers`), curves (`curves`), sample tables
(`samples`), pass@k (`sampled_metrics`), greedy evaluation (`evaluation`) and the per-rank safety services (`safety_services`).
docs/run-directory.md describes what a run leaves behind.
"""
