"""Weight sync, trainer to rollout engine, and when it happens: `weight_sync` publishes after the
update and delivers before generation; `timeshare` runs the phases when trainer and engine share a
device. How the weights travel is the engine's (rltrain.rollout, rltrain.transport). docs/time-sharing-and-sync.md.
"""
