"""What every rank's process shares: process groups and the one module of collective helpers
(`distributed`), dtypes (`precision`), user errors and their per-rank reports (`errors`), quieted
library output (`library_noise`), process-global state reset between sweep jobs (`process_state`) and
importing the user's functions that config keys name (`user_code`).
"""
