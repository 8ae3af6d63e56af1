"""Tensor parallelism: one model over N ranks (docs/design.md §17).

`group` (the process groups), `layers` (column/row/vocab-parallel), `shard` (a model and its
spec cut into one rank's part), `runner` (`TPRunner`: rank 0 prepares, every rank executes).
Every rank is built by `worker/assembly/rank.py`; rank 0 starts and stops the others.
"""

from worker.parallel.group import TPAddress, TPGroup

__all__ = ["TPAddress", "TPGroup"]
