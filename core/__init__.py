"""The floor every layer stands on: torch-free values and rules that the worker, the cluster
index and the router share (docs/design.md §3).

- `geometry` — page rounding and `Geometry`, a worker's page size, window and SWA layers;
- `events` — page hashes and cache events; `reuse` — what a match reuses or repairs;
- `sampling_params`, `outputs` — a request's parameters and what comes back.

Nothing here imports torch, numpy or any other package of this repository.
"""
