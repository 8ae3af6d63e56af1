"""A hostile client beside a plain one, against a real `swaserve serve --workers 2` (the tiny model,
loopback Ray): the bystander's latency stays within 2x of the idle server's and `/health` answers
within 1 s throughout; afterwards the pools are idle, nothing is lost and no replica restarted.

How the 2x is measured, honestly: one server, windows alternating idle / attacked `ROUNDS` times
(each idle window starts once the server is idle again), so whatever else loads the machine falls
on both kinds of window alike. In every window the bystander sends plain, non-streaming
completions one after another (a fresh 32-token prompt each, 16 greedy tokens: no cache hit in
either kind of window); its latency is client-side, from send to the whole answer. An idle
window is IDLE_REQUESTS of them; an attacked window lasts one pass of the attacker
(tests/deploy/attacks.py: every attack once, one at a time, in a process of its own, under a
`cache_salt` of its own), so it includes the attacks' real work on the workers (a context-long
prefill, never a cache hit; 1,024 forced tokens; 256 sequences): the bystander shares the workers' steps and the machine's cores with them, which is
part of what is measured. Asserted: the median of all attacked samples (about 270) at most twice
the median of all idle ones (72), and their p90 at most twice the idle p90; single slow requests
(a grammar compiling beside them) are printed, not asserted. Before the measured rounds one
unmeasured attack pass pays what each replica pays once, whoever asks (a grammar engine's
tokenizer, compiled shapes of new batch sizes): no attack a client can repeat (an earlier run
that counted it saw a bystander request of 6.8 s and `/health` at 1.2 s, at load 34).

`/health` is probed every 0.2 s by a thread of its own in every window, and so is `/v1/models`
(answered by the ingress's loop alone, where `/health` also asks the cache index actor): a slow
`/health` with a fast `/v1/models` is the actor, with both slow the ingress or the machine. Every
`/health` answer in the measured windows (idle and attacked) must come within 1 s.

The per-attack table printed at the end (BENCHMARKS.md "hostile client") gives, for each attack, the
bystander requests that overlapped it: their median latency and the slowest, over the idle
median, and the slowest `/health` answer while it ran.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.attacks import MODEL, Outcome, attack_pass
from tests.serve_process import serve

pytestmark = [pytest.mark.ray, pytest.mark.loaded, pytest.mark.timeout(900)]

ROUNDS = 3
IDLE_REQUESTS = 24  # bystander requests per idle window
PASS_TIMEOUT_S = 600  # one attack pass ends by itself well before (client timeouts)
IDLE_TIMEOUT_S = 120  # after a pass, the server is idle again within this
HEALTH_EVERY_S = 0.2
BYSTANDER_TOKENS = 16


@dataclass
class Sample:
    window: str  # "idle" | "attack"
    sent: float
    seconds: float
    status: int


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`swaserve serve --workers 2` on loopback (no API key), stopped with Ctrl-C at the end."""
    with serve(tmp_path_factory.mktemp("serve"), f"model: {MODEL}\nworkers: 2\n") as srv:
        yield srv.url


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.25)  # waits on the condition


def _metrics(url: str) -> dict[str, Any]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _replicas(url: str) -> set[str]:
    """The worker replicas that answered this scrape (their ids change when one restarts)."""
    return {s.labels["replica"] for s in _metrics(url)["swaserve_replica_up"].samples if s.value == 1}


def _idle(url: str) -> bool:
    """No request in flight at the ingress or in an engine, and no KV held by one: every pool's
    tokens free or evictable (cached)."""
    m = _metrics(url)
    busy = [s.value for name in ("swaserve_requests_in_flight", "swaserve_requests_running",
                                 "swaserve_requests_waiting", "swaserve_kv_used_tokens")
            for s in m[name].samples]  # fmt: skip
    return not any(busy)


# ---- the two clients and the probe -----------------------------------------------------------


class Bystander:
    """Plain completions, one after another, each on a fresh prompt."""

    def __init__(self, url: str) -> None:
        self._http = httpx.Client(base_url=url, timeout=120)
        self._rng = random.Random(28)
        self.samples: list[Sample] = []

    def run(self, window: str, done: Callable[[int], bool]) -> None:
        n = 0
        while not done(n):
            prompt = [self._rng.randrange(5, 1000) for _ in range(32)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": BYSTANDER_TOKENS, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            t0 = time.monotonic()
            r = self._http.post("/v1/completions", json=body)
            self.samples.append(Sample(window, t0, time.monotonic() - t0, r.status_code))
            n += 1

    def close(self) -> None:
        self._http.close()


class Probe:
    """`GET path` every HEALTH_EVERY_S on a thread; each answer's time, in its window."""

    def __init__(self, url: str, path: str) -> None:
        self.window = "idle"
        self.samples: list[Sample] = []
        self._url, self._path = url, path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=30) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    status = http.get(self._path).status_code
                except httpx.HTTPError:
                    status = -1
                self.samples.append(Sample(self.window, t0, time.monotonic() - t0, status))
                self._stop.wait(HEALTH_EVERY_S)  # the probe's period

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


_PASSES = itertools.count()


def _attacked_window(url: str, bystander: Bystander, probes: list[Probe], window: str) -> list[Outcome]:
    """One attack pass in its own process while the bystander keeps sending."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    attacker = ctx.Process(target=attack_pass, args=(url, f"pass-{next(_PASSES)}", out), daemon=True)
    for p in probes:
        p.window = window
    attacker.start()
    bystander.run(window, lambda n: not attacker.is_alive() or not out.empty())
    outcomes = [Outcome(**o) for o in out.get(timeout=PASS_TIMEOUT_S)]
    attacker.join(30)
    for p in probes:
        p.window = "idle"
    return outcomes


# ---- the test -----------------------------------------------------------------------------------


def test_a_hostile_client_does_not_slow_a_bystander(url: str) -> None:
    """Alternating idle and attacked windows: the bystander's median and p90 latency under attack
    within 2x of idle, /health within 1 s in every window, every answer the expected one; then
    idle pools, the same replicas."""
    # Each replica's stats reach the ingress on their own schedule (about every second, and
    # stale after 3 s): wait until both have answered a scrape.
    _wait(lambda: len(_replicas(url)) == 2, IDLE_TIMEOUT_S, "both worker replicas reporting")
    replicas = _replicas(url)
    bystander, probe, loop = Bystander(url), Probe(url, "/health"), Probe(url, "/v1/models")
    outcomes: list[Outcome] = []
    try:
        bystander.run("warm-up", lambda n: n >= 4)
        warm_up = _attacked_window(url, bystander, [probe, loop], "warm-up")
        for _ in range(ROUNDS):
            _wait(lambda: _idle(url), IDLE_TIMEOUT_S, "idle server")
            bystander.run("idle", lambda n: n >= IDLE_REQUESTS)
            outcomes += _attacked_window(url, bystander, [probe, loop], "attack")
        _wait(lambda: _idle(url), IDLE_TIMEOUT_S, "idle server after the attacks")
    finally:
        probe.stop()
        loop.stop()
        bystander.close()
    _report(outcomes, bystander.samples, probe.samples, loop.samples)
    _wait(lambda: len(_replicas(url)) == 2, IDLE_TIMEOUT_S, "both worker replicas reporting")
    assert _replicas(url) == replicas, "a worker replica restarted"
    assert [o for o in warm_up + outcomes if not o.expected] == []
    assert all(s.status == 200 for s in bystander.samples), "a bystander request failed"
    assert all(s.status == 200 for s in probe.samples), "/health answered other than 200"
    idle, attacked = _seconds(bystander.samples, "idle"), _seconds(bystander.samples, "attack")
    assert statistics.median(attacked) <= 2 * statistics.median(idle)
    assert _p90(attacked) <= 2 * _p90(idle)
    assert max(_seconds(probe.samples, "idle") + _seconds(probe.samples, "attack")) <= 1.0


def _seconds(samples: list[Sample], window: str) -> list[float]:
    return [s.seconds for s in samples if s.window == window]


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def _report(outcomes: list[Outcome], bystander: list[Sample], health: list[Sample], loop: list[Sample]) -> None:
    """The figures: bystander and probes per window, then per attack over the measured passes
    (the bystander requests and /health probes that overlapped it)."""
    idle = statistics.median(_seconds(bystander, "idle"))
    print(f"\nload average {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores")
    for window in ("warm-up", "idle", "attack"):
        s, h, m = _seconds(bystander, window), _seconds(health, window), _seconds(loop, window)
        print(f"{window}: bystander n={len(s)} median {statistics.median(s) * 1000:.0f} ms "
              f"p90 {_p90(s) * 1000:.0f} ms max {max(s) * 1000:.0f} ms; /health n={len(h)} "
              f"median {statistics.median(h) * 1000:.0f} ms max {max(h) * 1000:.0f} ms "
              f"(> 0.5 s: {sum(x > 0.5 for x in h)}); /v1/models max {max(m) * 1000:.0f} ms")  # fmt: skip
    print("| attack | answer | seconds (slowest pass) | bystander requests during it |"
          " their median / idle median | slowest / idle median | slowest /health |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    names = list(dict.fromkeys(o.name for o in outcomes))
    for name in names:
        runs = [o for o in outcomes if o.name == name]
        during = [s.seconds for o in runs for s in _overlapping(bystander, o) if s.window == "attack"]
        probes = [s.seconds for o in runs for s in _overlapping(health, o)]
        med = f"{statistics.median(during) / idle:.2f}" if during else "—"
        slow = f"{max(during) / idle:.2f}" if during else "—"
        worst = f"{max(probes) * 1000:.0f} ms" if probes else "—"
        answer = "/".join(sorted({str(o.status) if o.status else "dropped" for o in runs}))
        print(f"| {name} | {answer} | {max(o.seconds for o in runs):.2f} | {len(during)} | {med} | {slow} | {worst} |")


def _overlapping(samples: list[Sample], o: Outcome) -> list[Sample]:
    end = o.started + o.seconds
    return [s for s in samples if s.sent < end and s.sent + s.seconds > o.started]
