"""Scheduling: the `Req` life cycle, two-pool admission math, and the `Scheduler` that owns
every request state change."""
