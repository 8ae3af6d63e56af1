"""`Engine`: one device's serving loop — scheduler, radix cache, hybrid pools, model runner.

Driven two ways with the same code: `generate()` steps it in the caller's thread until the given
prompts finish (offline); `worker.engine.async_engine.AsyncEngine` steps it on a background thread and
streams `StreamDelta`s. `add_request` and `abort` are thread-safe (they go through an inbox the
step drains); everything else runs on the stepping thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable, Sequence

import torch

from worker.config import EngineConfig
from worker.engine.setup import EngineParts, build_engine_parts
from worker.engine.stats import PoolPeaks, engine_stats
from worker.engine.stopping import StopChecker
from worker.outputs import EngineStats, Output, StreamDelta, TokenLogprob
from worker.runner.sampler import make_generator
from worker.sampling_params import SamplingParams
from worker.scheduler.request import Req, ReqState
from worker.scheduler.scheduler import Scheduler, SchedulerLimits, StepWork

logger = logging.getLogger(__name__)

DeltaSink = Callable[[StreamDelta], None]


class Engine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        self.config = config
        self.parts = parts or build_engine_parts(config)
        p = self.parts
        self.spec, self.allocator, self.cache, self.runner = p.spec, p.allocator, p.cache, p.runner
        self.max_model_len = p.max_model_len
        self.scheduler = Scheduler(
            SchedulerLimits(
                page_size=config.page_size,
                window=p.cache_window,
                chunked_prefill_size=config.chunked_prefill_size,
                max_running_requests=config.max_running_requests,
                swa_eviction_interval=config.swa_eviction_interval,
                radix=config.enable_radix_cache,
            ),
            self.allocator,
            self.cache,
            on_retract=self._release_kv,
        )
        self.stopper = StopChecker(p.eos_token_ids, p.tokenizer_loader)
        self.peaks = PoolPeaks()
        self.counters: dict[str, float] = dict.fromkeys(
            ("cache_hit_tokens", "prompt_tokens", "generated_tokens", "aborts", "steps"), 0
        )
        self.last_step_seconds = 0.0
        self._idle_steps = 0  # consecutive steps that scheduled nothing while requests existed
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._reqs: dict[str, Req] = {}
        self._sinks: dict[str, DeltaSink] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (message names what to change) for a request that can never run."""
        params.validate()
        if params.stop:
            self.stopper.check_stop_strings_supported()
        n = len(token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: send at least one token")
        vocab = self.spec.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds the model's context of {self.max_model_len} tokens; shorten the prompt or "
                "lower max_tokens"
            )
        P = self.config.page_size
        need = -(-(n + params.max_tokens) // P) * P + P
        if need > self.allocator.full_size:
            raise ValueError(
                f"the request needs {need} tokens of KV but the KV pool holds "
                f"{self.allocator.full_size}; lower max_tokens or raise the KV budget"
            )

    def add_request(
        self,
        token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_delta: DeltaSink | None = None,
    ) -> str:
        """Queue a request (thread-safe). Raises ValueError if it can never run."""
        if request_id is not None and request_id in self._reqs:
            raise ValueError(f"duplicate request id {request_id!r}: it is still running")
        req = self._new_req(token_ids, params, request_id)
        self._inbox.put(("add", (req, on_delta)))
        return req.rid

    def _new_req(self, token_ids: Sequence[int], params: SamplingParams, rid: str | None) -> Req:
        self.validate(token_ids, params)
        rid = rid or f"req-{next(self._ids)}"
        return Req(rid=rid, prompt=list(token_ids), params=params, generator=make_generator(params))

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its KV is freed at the next step (thread-safe)."""
        self._inbox.put(("abort", request_id))

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running) or not self._inbox.empty()

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Admit, schedule, run one forward, sample, finish. Returns this step's deltas."""
        t0 = time.perf_counter()
        deltas = self._drain_inbox()
        work = self.scheduler.schedule()
        self.peaks.observe(self.allocator, self.cache)
        if work:
            deltas += self._run(work)
            self.counters["steps"] += 1
        deltas += self._refuse_if_stalled(bool(work) or bool(deltas))
        self.last_step_seconds = time.perf_counter() - t0
        return deltas

    def _refuse_if_stalled(self, progressed: bool) -> list[StreamDelta]:
        """Scheduling is deterministic and only a forward or an abort frees memory: two steps in
        a row that schedule nothing while requests exist will repeat forever. Refuse the newest
        request with a clear error instead of hanging (e.g. an SWA pool barely above W + P whose
        window locks leave a lone request no room)."""
        s = self.scheduler
        if progressed or not (s.running or s.waiting):
            self._idle_steps = 0
            return []
        self._idle_steps += 1
        if self._idle_steps < 2:
            return []
        self._idle_steps = 0
        victim = s.running[-1] if s.running else s.waiting[0]
        a = self.allocator
        self._finish(victim, "abort", error=(
            f"the KV pools cannot hold this request's next step (full pool {a.full_size} tokens, "
            f"SWA pool {a.swa_size} tokens, window {self.spec.window}, page {self.config.page_size}); "
            "raise swa_full_tokens_ratio or the KV budget, or lower chunked_prefill_size"
        ))  # fmt: skip
        self.counters["aborts"] += 1
        return [self._delta(victim)]

    def _run(self, work: list[StepWork]) -> list[StreamDelta]:
        from worker.runner.forward_batch import ForwardBatch, ForwardReq

        reqs = tuple(
            ForwardReq(w.req.kv.tokens[w.start : w.start + w.n], w.start, w.req.kv.table, w.samples)  # type: ignore[union-attr]
            for w in work
        )
        logits = self.runner.forward(ForwardBatch(reqs))
        samplers = [w.req for w in work if w.samples]
        sampled = self.runner.sample(logits, [r.params for r in samplers], [r.generator for r in samplers])
        for w in work:
            kv = w.req.kv
            assert kv is not None
            kv.kv_committed_len = w.start + w.n
            if not w.decode and self.config.enable_radix_cache:
                # Every prefill chunk, the last one too, goes into the tree now: the prompt
                # becomes tree-owned, so decode never frees its SWA and another request can
                # still reuse all of it (under SWA pressure the tree tombstones it instead).
                self.cache.cache_unfinished_req(kv)
        deltas = []
        for i, req in enumerate(samplers):
            lp = sampled.logprobs[i]
            logprob = None if lp is None else TokenLogprob(sampled.token_ids[i], lp, tuple(sampled.top_logprobs[i] or ()))
            deltas.append(self._append_token(req, sampled.token_ids[i], logprob))
        return deltas

    def _append_token(self, req: Req, token: int, logprob: TokenLogprob | None) -> StreamDelta:
        req.output.append(token)
        assert req.kv is not None
        req.kv.tokens.append(token)
        if logprob is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(logprob)
        self.counters["generated_tokens"] += 1
        reason = self.stopper.check(req)
        if reason is not None:
            self._finish(req, reason)
        return self._delta(req)

    # ---- finishing ------------------------------------------------------------------------------
    def _finish(self, req: Req, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error  # type: ignore[assignment]
        if req.state is ReqState.RUNNING:
            self.scheduler.running.remove(req)
            self._release_kv(req)
        elif req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        req.state = ReqState.FINISHED
        req.kv = None
        if req.cached_tokens < 0:
            req.cached_tokens = 0
        self.counters["cache_hit_tokens"] += req.cached_tokens
        self.counters["prompt_tokens"] += len(req.prompt)

    def _release_kv(self, req: Req) -> None:
        kv = req.kv
        if kv is None:
            return
        # The tree takes only committed (written) KV; the rest of the allocation is freed.
        self.cache.cache_finished_req(kv, insert=self.config.enable_radix_cache)

    def _delta(self, req: Req) -> StreamDelta:
        new = req.output[req.emitted :]
        lps = req.logprobs[req.emitted :] if req.logprobs is not None else None
        req.emitted = len(req.output)
        delta = StreamDelta(
            request_id=req.rid,
            token_ids=new,
            finished=req.state is ReqState.FINISHED,
            finish_reason=req.finish_reason,
            prompt_len=len(req.prompt),
            cached_tokens=max(req.cached_tokens, 0),
            completion_tokens=len(req.output),
            logprobs=lps,
            error=req.error,
        )
        sink = self._sinks.get(req.rid)
        if sink is not None:
            sink(delta)
        if delta.finished:
            self._reqs.pop(req.rid, None)
            self._sinks.pop(req.rid, None)
        return delta

    def _drain_inbox(self) -> list[StreamDelta]:
        deltas = []
        while not self._inbox.empty():
            op, arg = self._inbox.get_nowait()
            if op == "add":
                req, sink = arg  # type: ignore[misc]
                if req.rid in self._reqs:
                    # NOTE: two adds raced past add_request's check. Raising here would fail the
                    # step every request shares; refuse only the newcomer, through its own sink.
                    # (Not in the step's deltas: they would "finish" the running request.)
                    self._refuse(req, sink, f"duplicate request id {req.rid!r}")
                    continue
                self._reqs[req.rid] = req
                if sink is not None:
                    self._sinks[req.rid] = sink
                self.scheduler.waiting.append(req)
            elif op == "abort":
                req = self._reqs.get(arg)  # type: ignore[arg-type]
                if req is not None and req.state is not ReqState.FINISHED:
                    self._finish(req, "abort")
                    self.counters["aborts"] += 1
                    deltas.append(self._delta(req))
        return deltas

    @staticmethod
    def _refuse(req: Req, sink: DeltaSink | None, error: str) -> None:
        req.state, req.finish_reason, req.error = ReqState.FINISHED, "abort", error
        if sink is not None:
            sink(StreamDelta(req.rid, [], True, "abort", len(req.prompt), 0, 0, error=error))

    # ---- offline --------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Output]:
        """Run these prompts to completion (blocking) and return their outputs in order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        reqs = [self._new_req(p, sp, None) for p, sp in zip(prompts, plist)]
        for req in reqs:
            self._inbox.put(("add", (req, None)))
        while any(r.state is not ReqState.FINISHED for r in reqs):
            self.step()
        return [self._output(r) for r in reqs]

    @staticmethod
    def _output(req: Req) -> Output:
        return Output(
            request_id=req.rid,
            prompt_len=len(req.prompt),
            token_ids=list(req.output),
            finish_reason=req.finish_reason or "abort",
            cached_tokens=max(req.cached_tokens, 0),
            logprobs=req.logprobs,
            error=req.error,
        )

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        self.counters["queued_prefill_tokens"] = sum(r.remaining for r in s.waiting) + sum(
            r.remaining for r in s.running if not r.is_decoding
        )
        self.counters["running_decodes"] = sum(1 for r in s.running if r.is_decoding)
        self.counters["retractions"] = s.retractions
        self.counters["full_evicted_tokens"] = s.evicted["full"]
        self.counters["swa_evicted_tokens"] = s.evicted["swa"]
        return engine_stats(self.allocator, self.cache, self.peaks, len(s.waiting), len(s.running),
                            self.counters, self.last_step_seconds)  # fmt: skip

    def check_integrity(self) -> None:
        """Raise when any pool/cache invariant breaks (reference §1.6), incl. the leak identity."""
        running = [r.kv for r in self.scheduler.running if r.kv is not None]
        self.allocator.check_integrity()
        self.cache.check_integrity(running)
        if not running:
            self._check_idle_pools()

    def _check_idle_pools(self) -> None:
        # NOTE: the cache checks the leak identity only when given running requests; with none,
        # no lock may be held and every slot must be free or the tree's.
        a, c = self.allocator, self.cache
        pools = [("full", a.full_size, a.full_available_size(), c.full_evictable, c.full_protected)]
        if a.hybrid:
            swa = ("SWA", a.swa_size, a.swa_available_size(), c.swa_evictable, c.swa_protected)
            pools.append(swa)
        for name, total, free, evictable, protected in pools:
            if protected or free + evictable != total:
                raise AssertionError(
                    f"{name} pool with no running request: free {free} + evictable {evictable} != "
                    f"total {total}, protected {protected} (a leaked slot or lock)"
                )

    def flush_cache(self) -> bool:
        """Empty the radix cache. Only when idle (returns False otherwise)."""
        if self.scheduler.running or self.scheduler.waiting:
            return False
        self.cache.reset()
        return True

    def drain_cache_events(self) -> list:
        return self.cache.drain_events()

    def cache_snapshot(self) -> dict:
        return self.cache.snapshot_pages()

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny request end to end, so the first user request pays no lazy setup."""
        self.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        self.flush_cache()
