"""The hosts of an engine, each an `EngineClient` (`worker/engine/protocols.py`): `AsyncEngine`
steps it on a thread of the caller's process, `EngineProcess` in a child process of its own
(`worker.hosts.engine_process` run as `__main__`, docs/design.md §20)."""
