"""`Engine`: one device's serving loop — scheduler, radix cache, hybrid pools, model runner.

One step is three moves, with no call back from the scheduler into the engine:

    plan = scheduler.schedule()            who runs, with which tokens (KV allocated)
    logits = runner.forward(plan); sample  compute
    scheduler.commit / append_token / finish  every state change, by the scheduler

The engine writes no request state: what it keeps per request id is the consumer's side, the
delta sink and the stream cursor (what was handed out).

Driven two ways with the same code: `generate()` steps it in the caller's thread until the given
prompts finish (offline); `worker.hosts.async_engine.AsyncEngine` steps it on a background
thread and streams `StreamDelta`s. `add_request` and `abort` are thread-safe (they go through an
inbox the step drains); `stats()` returns the snapshot the last step published; everything else
runs on the stepping thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable, Sequence

from core.events import CacheEvent, PageState
from core.geometry import ceil_page
from core.outputs import EngineStats, FinishReason, Output, StreamDelta, TokenLogprob
from core.reuse import TierCosts
from core.sampling_params import SamplingParams
from worker.assembly.builder import build_engine_parts
from worker.assembly.parts import EngineParts
from worker.assembly.ranks import RankLauncher
from worker.config import (
    EngineConfig,
    overlaps,
    prefill_budget,
    repairs_tombstones,
)
from worker.engine.overlap import Forwarder, Launched, forward_reqs, sample_index
from worker.engine.stats import EngineCounters, PoolPeaks, snapshot
from worker.engine.step_io import StreamCursor, sample_row, stream_delta
from worker.engine.stopping import StopChecker
from worker.runner.forward_batch import ForwardBatch, ForwardOutput
from worker.runner.noise import seed_key
from worker.scheduler.plan import SchedulerLimits, StepWork
from worker.scheduler.request import Req, ReqState
from worker.scheduler.scheduler import Scheduler
from worker.structured.grammar import GrammarCompiler
from worker.structured.masks import MaskFiller

logger = logging.getLogger(__name__)

DeltaSink = Callable[[StreamDelta], None]
# What a request that failed alone is told (the details are in the worker's log).
TOKEN_CHECK_FAILED = "checking this request's new token (grammar, stop conditions) failed"
CONSUMER_FAILED = "this request's output could not be handed to its consumer"
_Add = tuple[Req, DeltaSink | None]


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        parts: EngineParts | None = None,
        launcher: RankLauncher | None = None,  # tensor parallelism: who starts ranks 1..N-1
    ) -> None:
        self.config = config
        self.parts = parts or build_engine_parts(config, launcher)
        p = self.parts
        self.spec, self.allocator, self.cache, self.runner = p.spec, p.allocator, p.cache, p.runner
        self.max_model_len = p.max_model_len
        self.geometry = p.geometry
        self.scheduler = Scheduler(
            SchedulerLimits(
                geometry=self.geometry,
                chunked_prefill_size=prefill_budget(config),
                max_running_requests=config.max_running_requests,
                swa_eviction_interval=config.swa_eviction_interval,
                radix=config.enable_radix_cache,
                tombstone_repair=repairs_tombstones(config),
                max_num_batched_tokens=config.max_num_batched_tokens,
                tier_costs=p.tier_costs,
            ),
            self.allocator,
            self.cache,
        )
        self.stopper = StopChecker(p.eos_token_ids, p.tokenizer_loader)
        self.grammars = GrammarCompiler(p.tokenizer_loader, self.spec.vocab_size)
        self.masks = MaskFiller(self.spec.vocab_size)
        self.peaks = PoolPeaks()
        self.counters = EngineCounters()
        self.last_step_seconds = 0.0
        self.forwarder = Forwarder(overlap=overlaps(config))
        self._inflight: Launched | None = None  # the step whose tokens are not processed yet
        self._inbox: queue.SimpleQueue[_Add | str] = queue.SimpleQueue()  # adds, or ids to abort
        self._sinks: dict[str, DeltaSink] = {}
        self._cursors: dict[str, StreamCursor] = {}  # what each consumer was handed so far
        self._ids = itertools.count()
        self._stats = self._snapshot()

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (message names what to change) for a request that can never run
        (a grammar is compiled to check it: call off the step thread)."""
        self._check(token_ids, params)
        if params.grammar is not None:
            self.grammars.compile(params.grammar)

    def _check(self, token_ids: Sequence[int], params: SamplingParams) -> None:
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
        need = ceil_page(n + params.max_tokens, P) + P
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
        follows: str | None = None,
    ) -> str:
        """Queue a request (thread-safe; a grammar is compiled in the caller's thread). Raises
        ValueError if it can never run. `follows`: the id of an earlier request with the same
        prompt (another choice of it): this one starts once that prompt is in the cache."""
        if request_id is not None and request_id in self.scheduler.reqs:
            raise ValueError(f"duplicate request id {request_id!r}: it is still running")
        req = self._new_req(token_ids, params, request_id, follows)
        self._inbox.put((req, on_delta))
        return req.rid

    def _new_req(
        self, token_ids: Sequence[int], params: SamplingParams, rid: str | None, follows: str | None = None
    ) -> Req:
        self._check(token_ids, params)
        return Req(
            rid=rid or f"req-{next(self._ids)}",
            prompt=list(token_ids),
            params=params,
            key=seed_key(params.seed),
            prompt_logprobs=None if params.prompt_logprobs is None else [],
            grammar=None if params.grammar is None else self.grammars.compile(params.grammar),
            follows=follows,
        )

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its KV is freed at the next step (thread-safe)."""
        self._inbox.put(request_id)

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running) or not self._inbox.empty() or self._inflight is not None

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Admit, schedule, run one forward, sample, finish. Returns this step's deltas. With
        overlap scheduling the forward runs on the forward thread and its tokens are processed
        by the next call (after that call's step is submitted: docs/design.md §11.8)."""
        t0 = time.perf_counter()
        deltas = self._drain_inbox()
        if self._inflight is not None and self._inflight.needs_history:
            deltas += self._settle()  # grammar masks and penalties read every token so far
        work = self.scheduler.schedule()
        self.peaks.observe(self.allocator, self.cache)
        previous, self._inflight = self._inflight, None
        if work:
            self._inflight = self._launch(work, previous)
            self.counters.steps += 1
        if previous is not None:
            deltas += self._process(previous)
        if self._inflight is not None and not self._inflight.overlapped:
            deltas += self._settle()
        if self._inflight is None and (copy := self._copies()) is not None:
            copy()  # no forward to run them before, none in flight: now (docs/design.md §9.9)
        # Processing the step that was in flight commits a forward: progress, like a new step.
        refused = self.scheduler.refuse_if_stalled(bool(work) or bool(deltas) or previous is not None)
        if refused is not None:
            deltas.append(self._delta(refused))
        self.last_step_seconds = time.perf_counter() - t0
        self._stats = self._snapshot()
        return deltas

    def _launch(self, work: list[StepWork], previous: Launched | None) -> Launched:
        """Hand the step to the forwarder, then commit it: the KV it writes is there before any
        later step reads it (steps run in order)."""
        fwd = forward_reqs(work, previous)
        samplers = [w for w in work if w.samples]
        prompt_only = [w.req for w in work if w.reaches_end and not w.samples]
        rows = [sample_row(w.req, self.stopper.eos) for w in samplers]
        masks = self.masks.start([(w.req.grammar, w.req.generated) for w in samplers])
        index = sample_index(fwd, [w.samples for w in work])
        result, overlapped = self.forwarder.submit(
            self.runner, ForwardBatch(fwd), index, rows, masks, previous.result if previous else None,
            before=self._copies(),
        )  # fmt: skip
        self.scheduler.commit(work)
        self.scheduler.launched(work)
        history = any(w.req.grammar is not None or w.req.params.penalized for w in samplers)
        rows_of = {w.req: i for i, w in enumerate(samplers)}
        return Launched(work, fwd, samplers, prompt_only, result, rows_of, history, overlapped)

    def _copies(self) -> Callable[[], None] | None:
        """The KV copies between tiers the step decided, to run just before its forward."""
        host = self.parts.host
        batch = host.tier.queue.take() if host is not None else None
        if host is None or batch is None:
            return None
        copier = host.copier
        return lambda: copier.issue(batch)

    def _settle(self) -> list[StreamDelta]:
        """Process the step in flight, if any (waits for its forward)."""
        launched, self._inflight = self._inflight, None
        return self._process(launched) if launched is not None else []

    def _process(self, launched: Launched) -> list[StreamDelta]:
        """This step's results, request by request. Its forward and sampling failing as a whole
        fails the step (raised here); what one request alone needs failing (its prompt
        logprobs, its sampling row, its token's grammar or stop check) ends that request, with
        an error saying which, and the others go on (docs/design.md §4.1)."""
        res = launched.result.result()
        deltas = self._prompt_logprobs(launched, res.forward)
        deltas += [self._prompt_only_done(r) for r in launched.prompt_only if r.state is not ReqState.FINISHED]
        sampled = res.sampled
        unsampled = set(sampled.unsampled)
        for i, w in enumerate(launched.samplers):
            req = w.req
            self.scheduler.landed(w)
            if req.state is ReqState.FINISHED:
                continue  # ended while this step ran (an abort, or its previous token stopped it)
            if i in sampled.failed:
                deltas.append(self._fail(req, sampled.failed[i]))
            elif i in unsampled:
                deltas.append(self._end_unsampled(req))
            else:
                token, lp = sampled.token_ids[i], sampled.logprobs[i]
                top = sampled.top_logprobs[i] or ()
                logprob = None if lp is None else TokenLogprob(token, lp, tuple(top))
                deltas.append(self._on_token(req, token, logprob))
        return deltas

    def _prompt_logprobs(self, launched: Launched, out: ForwardOutput) -> list[StreamDelta]:
        """Record what the runner made of each request's prompt rows; a request whose rows
        failed ends alone."""
        deltas = []
        for i, error in out.prompt_errors.items():
            if launched.work[i].req.state is not ReqState.FINISHED:
                deltas.append(self._fail(launched.work[i].req, error))
        for i, logprobs in out.prompt_logprobs.items():
            w, f = launched.work[i], launched.fwd[i]
            rows = f.prompt_logprobs
            assert rows is not None and w.req.prompt_logprobs is not None
            assert len(w.req.prompt_logprobs) == f.prefix_len + rows.first, (
                f"request {w.req.rid}: prompt logprobs of position {f.prefix_len + rows.first} "
                f"arrived after {len(w.req.prompt_logprobs)} (out of order)"
            )
            self.scheduler.record_prompt_logprobs(w.req, logprobs)
        return deltas

    def _on_token(self, req: Req, token: int, logprob: TokenLogprob | None) -> StreamDelta:
        self.counters.generated_tokens += 1
        try:
            self.scheduler.append_token(req, token, logprob)  # its grammar accepts it here
            reason = self._stop_reason(req)
        except Exception:  # noqa: BLE001 - only this request's grammar or stop check failed
            logger.exception("request %s: checking its new token failed; it ends alone", req.rid)
            return self._fail(req, TOKEN_CHECK_FAILED)
        if reason is not None:
            grammar = req.grammar
            error = f"structured output: {grammar.failed}" if grammar and grammar.failed else None
            self.scheduler.finish(req, reason, error=error)
        return self._delta(req)

    def _stop_reason(self, req: Req) -> FinishReason | None:
        """Why the newest token ends the request: its grammar refused it (abort), or a stop
        condition (`StopChecker`); None: it goes on."""
        if req.grammar is not None and req.grammar.failed:
            return "abort"
        return self.stopper.check(req)

    def _fail(self, req: Req, error: str) -> StreamDelta:
        """End `req` alone (abort, `error` saying what failed): a part of the step only it
        needed raised, and was logged where it did."""
        if req.state is not ReqState.FINISHED:
            self.scheduler.finish(req, "abort", error=error)
        return self._delta(req)

    def _end_unsampled(self, req: Req) -> StreamDelta:
        """No token was left to sample: the request ends alone, with an error that says why."""
        if req.grammar is not None and req.grammar.failed:
            error = f"structured output: {req.grammar.failed}"
        elif req.grammar is not None:
            error = ("structured output: the grammar allows no token here that the request's "
                     "logit_bias, min_tokens and stop_token_ids leave open")  # fmt: skip
        else:
            error = "sampling: the model gave no finite logit for any token the request allows"
        logger.warning("request %s ends without a token: %s", req.rid, error)
        self.scheduler.finish(req, "abort", error=error)
        return self._delta(req)

    def _prompt_only_done(self, req: Req) -> StreamDelta:
        self.scheduler.finish(req, "length")  # max_tokens 0: the prompt was all there was to do
        return self._delta(req)

    def _delta(self, req: Req) -> StreamDelta:
        cursor = self._cursors.setdefault(req.rid, StreamCursor())
        delta = stream_delta(req, cursor)
        sink = self._sinks.get(req.rid)
        if sink is not None and not self._hand(sink, delta, req):
            delta = stream_delta(req, cursor)  # its end (only the step's caller sees it)
        if delta.finished:
            self._sinks.pop(req.rid, None)
            self._cursors.pop(req.rid, None)
        return delta

    def _hand(self, sink: DeltaSink, delta: StreamDelta, req: Req) -> bool:
        """Give the consumer its delta; False when it raised (it is gone: the request ends)."""
        try:
            sink(delta)
            return True
        except Exception:  # noqa: BLE001 - that consumer's request alone
            logger.exception("request %s: its consumer failed; aborting it", req.rid)
            self._sinks.pop(req.rid, None)
            if req.state is not ReqState.FINISHED:
                self.scheduler.finish(req, "abort", error=CONSUMER_FAILED)
            return False

    def _drain_inbox(self) -> list[StreamDelta]:
        deltas = []
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, str):
                req = self.scheduler.abort(item)
                if req is not None:
                    deltas.append(self._delta(req))
                continue
            req, sink = item
            if self.scheduler.add(req):
                if sink is not None:
                    self._sinks[req.rid] = sink
            elif sink is not None:
                # NOTE: two adds raced past add_request's check. Raising here would fail the
                # step every request shares; the newcomer is refused through its own sink
                # (not in the step's deltas: they would "finish" the running request).
                refusal = StreamDelta(req.rid, [], True, "abort", len(req.prompt), 0, 0, error=req.error)
                try:
                    sink(refusal)
                except Exception:  # noqa: BLE001 - its consumer is gone; nothing else to end
                    logger.exception("request %s: its consumer failed on its refusal", req.rid)
        return deltas

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
            self._inbox.put((req, None))
        while any(r.state is not ReqState.FINISHED for r in reqs):
            self.step()
        self._settle()  # a step in flight holds only requests that ended: let it finish
        return [_output(r) for r in reqs]

    # ---- introspection (stats from any thread; the rest on the stepping thread) -----------------
    def stats(self) -> EngineStats:
        """The snapshot published after the last step (or flush)."""
        return self._stats

    def _snapshot(self) -> EngineStats:
        return snapshot(self.scheduler, self.peaks, self.counters, self.last_step_seconds, self.parts.host)

    @property
    def tier_costs(self) -> TierCosts | None:
        """What a token costs this worker to prefill or load (None: no host tier)."""
        return self.parts.tier_costs

    def check_integrity(self) -> None:
        """Raise when any pool/cache invariant breaks (docs/design.md §12), incl. the leak identity."""
        running = [r.kv for r in self.scheduler.running if r.kv is not None]
        self.allocator.check_integrity()
        self.cache.check_integrity(running)
        self.scheduler.check_rows()
        if not running:
            self._check_idle_pools()
        if self.parts.tp is not None:
            self.parts.tp.check_pools()  # every rank's pools against the one allocator

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
        self._stats = self._snapshot()
        return True

    def rank_failure(self) -> str | None:
        """Tensor parallelism: why a rank is gone (the engine can no longer step), else None."""
        return self.parts.tp.failure() if self.parts.tp is not None else None

    def close(self, force: bool = False) -> None:
        """Stop the grammar-mask threads and the other tensor-parallel ranks (idempotent).
        `force`: end the ranks without the stop message (another thread may be mid-step)."""
        self.forwarder.close()
        self.masks.close()
        if self.parts.tp is not None:
            self.parts.tp.close(force)

    def drain_cache_events(self) -> list[CacheEvent]:
        return self.cache.drain_events()

    def cache_snapshot(self) -> dict[int, PageState]:
        return self.cache.snapshot_pages()


def _output(req: Req) -> Output:
    return Output(
        request_id=req.rid,
        prompt_len=len(req.prompt),
        token_ids=list(req.output),
        finish_reason=req.finish_reason or "abort",
        cached_tokens=max(req.cached_tokens, 0),
        logprobs=req.logprobs,
        error=req.error,
        prompt_logprobs=None if req.prompt_logprobs is None else [None, *req.prompt_logprobs],
        repaired_tokens=req.repaired_tokens,
        loaded_tokens=req.loaded_tokens,
    )
