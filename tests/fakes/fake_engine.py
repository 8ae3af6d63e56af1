"""A small stand-in for `worker.hosts.async_engine.AsyncEngine` (same public interface), for tests only.

It "generates" deterministic tokens (greedy: a function of the previous token; sampled: a seeded
RNG), keeps a token-granular KV budget per request so tests can watch KV being freed on abort,
and a prompt history that reports page-aligned prefix hits as `cached_tokens` (within one cache
salt, as the real cache shares KV).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

from core.events import CacheEvent, PageState
from core.outputs import EngineStats, PoolStats, StreamDelta, TokenLogprob
from core.reuse import TierCosts
from core.sampling_params import SamplingParams
from worker.config import EngineConfig


class FakeEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_dir: Path | None = None,
        vocab_size: int = 256,
        eos_token_id: int | None = None,
        step_s: float = 0.002,
        max_model_len: int = 512,
        total_tokens: int = 4096,
        script: list[int] | None = None,
    ) -> None:
        self.config = config
        self.model_dir = model_dir or Path(".")
        self.max_model_len = config.max_model_len or max_model_len
        self.window: int | None = None
        self.swa_layers = 0
        self.tier_costs: TierCosts | None = None
        self.error: BaseException | None = None
        self._vocab = vocab_size
        self._eos = eos_token_id
        self._step_s = step_s
        self._total = total_tokens
        self._script = script  # when set: every request generates exactly these tokens
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # request id -> KV tokens held
        self._aborted: set[str] = set()
        self._history: list[tuple[int, tuple[int, ...]]] = []  # (root hash, prompt)
        self._counters = {"prompt": 0, "generated": 0, "hits": 0, "aborts": 0, "steps": 0}
        self._peak = 0
        self.shut_down = False
        self.seen: list[tuple[str, SamplingParams, str | None]] = []  # (id, params, follows) per request

    # -- interface -------------------------------------------------------------------------

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: send at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens "
                f"exceeds max_model_len {self.max_model_len}"
            )

    async def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        follows: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        self.validate(token_ids, params)
        with self._lock:
            if request_id in self._held:  # as the engine's add refuses one
                raise ValueError(f"duplicate request id {request_id!r}: it is still running")
        self.seen.append((request_id, params, follows))
        cached = self._admit(request_id, token_ids, params.root_hash)
        rng = random.Random(params.seed if params.seed is not None else 0)
        last, produced, done = token_ids[-1], 0, False
        prompt_lps: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + [TokenLogprob(t, -1.0 - 0.01 * i, ()) for i, t in enumerate(token_ids[1:])]
        try:
            if params.max_tokens == 0:
                done = True
                yield StreamDelta(request_id, [], True, "length", len(token_ids), cached, 0,
                                  prompt_logprobs=prompt_lps)  # fmt: skip
                return
            while True:
                await asyncio.sleep(self._step_s)  # one simulated engine step, not a wait
                if request_id in self._aborted:
                    return
                tok = self._next(last, params, rng, produced)
                produced, last = produced + 1, tok
                self._grow(request_id)
                stop = tok == self._eos and not params.ignore_eos
                stop = stop or tok in (params.stop_token_ids or ())
                stop = stop or (self._script is not None and produced >= len(self._script))  # "EOS"
                done = stop or produced >= params.max_tokens
                lps = None
                if params.logprobs is not None:
                    top = tuple(((tok + i) % self._vocab, -0.5 - i) for i in range(params.logprobs))
                    lps = [TokenLogprob(tok, -0.5, top)]
                yield StreamDelta(
                    request_id=request_id,
                    token_ids=[tok],
                    finished=done,
                    finish_reason=("stop" if stop else "length") if done else None,
                    prompt_len=len(token_ids),
                    cached_tokens=cached,
                    completion_tokens=produced,
                    logprobs=lps,
                    prompt_logprobs=prompt_lps if produced == 1 else None,
                )
                if done:
                    return
        finally:
            self._release(request_id, aborted=not done)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._held:
                self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            used = sum(self._held.values())
            running = len(self._held)
        full = PoolStats(self._total, self._total - used, 0, used, self._peak)
        swa_total = self._total // 2
        swa = PoolStats(swa_total, swa_total - min(used, swa_total), 0, min(used, swa_total), 0)
        c = self._counters
        return EngineStats(
            full=full, swa=swa, hybrid=True, waiting=0, running=running,
            queued_prefill_tokens=0, running_decodes=running,
            cache_hit_tokens=c["hits"], prompt_tokens=c["prompt"], generated_tokens=c["generated"],
            full_evicted_tokens=0, swa_evicted_tokens=0, tombstone_tokens=0, retractions=0,
            aborts=c["aborts"], steps=c["steps"], last_step_seconds=self._step_s,
        )  # fmt: skip

    def check_integrity(self) -> None:
        with self._lock:
            assert all(v >= 0 for v in self._held.values()), "negative KV holding"

    def flush_cache(self) -> bool:
        with self._lock:
            if self._held:
                return False
            self._history.clear()
            return True

    def drain_cache_events(self) -> list[CacheEvent]:
        return []

    def cache_snapshot(self) -> dict[int, PageState]:
        return {}

    def drain_and_snapshot(self) -> tuple[list[CacheEvent], dict[int, PageState]]:
        return [], {}

    def shutdown(self) -> None:
        self.shut_down = True

    # -- internals -------------------------------------------------------------------------

    def _next(self, last: int, params: SamplingParams, rng: random.Random, produced: int = 0) -> int:
        if self._script is not None:
            return self._script[min(produced, len(self._script) - 1)]
        if not params.temperature:
            return (last * 31 + 7) % self._vocab
        return rng.randrange(self._vocab)

    def _admit(self, request_id: str, token_ids: list[int], root_hash: int) -> int:
        page = self.config.page_size
        best = 0
        with self._lock:
            for root, past in self._history:
                if root != root_hash:
                    continue
                n = 0
                while n < min(len(past), len(token_ids) - 1) and past[n] == token_ids[n]:
                    n += 1
                best = max(best, n // page * page)
            self._history.append((root_hash, tuple(token_ids)))
            self._held[request_id] = len(token_ids)
            self._counters["prompt"] += len(token_ids)
            self._counters["hits"] += best
            self._peak = max(self._peak, sum(self._held.values()))
        return best

    def _grow(self, request_id: str) -> None:
        with self._lock:
            self._held[request_id] += 1
            self._counters["generated"] += 1
            self._counters["steps"] += 1
            self._peak = max(self._peak, sum(self._held.values()))

    def _release(self, request_id: str, aborted: bool) -> None:
        with self._lock:
            self._held.pop(request_id, None)
            self._aborted.discard(request_id)
            self._counters["aborts"] += int(aborted)
