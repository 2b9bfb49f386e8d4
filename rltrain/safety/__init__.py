"""Reliability: no rank is ever left alone in a collective (`guard`, `step`, `runtime`), which errors
are never recovered (`error_kinds`), metric reduction (`metrics`), fault injection for tests
(`faults`), health endpoints, heartbeats and the hang watchdog. docs/failure-behaviour.md.
"""
