"""What every rank's process shares: process groups and the one module of collective helpers
(`distributed`), dtypes (`precision`), user errors and their per-rank reports (`errors`), quieted
library output (`library_noise`), process-global state (`process_state`), a process dying with its
parent (`parent_death`), torch threads (`threads`) and the user's functions, in killable workers
(`user_code`, `call_pool`). The lowest package: it imports no other.
"""
