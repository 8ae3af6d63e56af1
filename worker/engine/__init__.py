"""The engine loop: `Engine` (offline and stepped), `AsyncEngine` (a step thread for asyncio
callers), the parts an engine is built from, its stats and stop conditions."""
