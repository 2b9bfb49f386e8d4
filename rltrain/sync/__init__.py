"""Weight sync, trainer to rollout engine: *when* (`weight_sync`: publish after the update, deliver
before generation; `timeshare`: the phases when trainer and engine share a device), *how in
process* (`vllm_reload`: the vLLM CPU build's in-place reload) and *how across processes*
(`transport*`: shared-memory buckets, JSON metadata). docs/time-sharing-and-sync.md.
"""
