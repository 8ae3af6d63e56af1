"""How an engine is built: `build_engine_parts` (`builder.py`) makes rank 0's `EngineParts`
(`parts.py`) from an `EngineConfig`; every rank, one device being rank 0 of 1, builds its share
with the same steps (`rank.py`, pools sized by `pools.py`); ranks 1..N-1 are started by a
`RankLauncher` (`ranks.py`; local processes: `rank_processes.py`)."""
