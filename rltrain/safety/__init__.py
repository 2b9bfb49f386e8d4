"""Reliability: no rank is ever left alone in a collective (`guard`, `step`), which errors are never
recovered (`error_kinds`), metric reduction (`metrics`), fault injection for tests (`faults`),
health endpoints, heartbeats, the hang watchdog and the sync's parity check (`parity`). It imports
only rltrain.runtime; the loop runs these services through rltrain/run/safety_services.py.
"""
