"""One `swaserve serve` (tiny model, 2 workers, loopback Ray, no API key, a short write timeout)
for the session's end-to-end tests: test_openai_clients_e2e.py runs on it first,
test_openai_e2e.py last (its final test stops it with Ctrl-C)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serve_process import Server, serve

MODEL = "tiny"
WORKERS = 2
# Short enough that the slow-reader test waits seconds, long enough that no other test's client
# (a busy machine, CPU hogs) ever leaves a write waiting that long.
WRITE_TIMEOUT_S = 5
# The drain test's 4,000-token requests must finish inside the grace: a bound on a hang, not a
# timing (one took ~130 s after SIGTERM under CI's CPU hogs on a slow host; the default is 60 s).
GRACE_S = 600

__all__ = ["MODEL", "WORKERS", "Server"]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("serve"), f"write_timeout_s: {WRITE_TIMEOUT_S}\ngraceful_shutdown_timeout_s: {GRACE_S}\n",
               ["--model", MODEL, "--workers", str(WORKERS)]) as srv:  # fmt: skip
        yield srv
