"""Aborts at random points (waiting, mid chunked prefill, decoding) leak nothing, and requests
that can never run are refused up front."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from worker.engine.engine import Engine
from worker.scheduler.request import Req, ReqState

pytestmark = pytest.mark.usefixtures("overlap")  # every test with overlap off and on

GREEDY = dict(temperature=0.0, ignore_eos=True)
CHUNK = 16
KINDS = ("waiting", "prefill", "decode")


@dataclass
class Plan:
    """When to abort one request: `kind` None never; `after` picks the moment at random."""

    prompt: list[int]
    max_tokens: int
    kind: str | None
    after: int
    seen: int = 0  # matching observations so far
    got: list[int] = field(default_factory=list)
    reason: str | None = None
    aborted_in: str | None = None


def _find(engine: Engine, rid: str) -> Req | None:
    for req in list(engine.scheduler.waiting) + engine.scheduler.running:
        if req.rid == rid:
            return req
    return None


def _state(req: Req) -> str:
    if req.state is ReqState.WAITING:
        return "waiting"
    return "decode" if req.output else "prefill"


def _plans(rng: random.Random) -> list[Plan]:
    shared = tokens(24, seed=rng.randrange(1000))
    # Every kind at least once per seed; waiting aborts go to the back of the queue.
    kinds: list[str | None] = [
        "prefill",
        "decode",
        None,
        None,
        rng.choice(KINDS),
        None,
        "waiting",
        "waiting",
    ]
    plans = []
    for i, kind in enumerate(kinds):
        prefix = shared if i % 2 else []
        # A prefill abort needs at least `after` + 1 steps that end mid-prompt: > 3 chunks.
        low = 3 * CHUNK + 1 if kind == "prefill" else CHUNK + 4
        prompt = prefix + tokens(rng.randint(low, 4 * CHUNK), seed=rng.randrange(10_000))
        plans.append(Plan(prompt, rng.randint(4, 10), kind, after=rng.randint(0, 2)))
    return plans


def _maybe_abort(engine: Engine, rid: str, plan: Plan) -> None:
    req = _find(engine, rid)
    if plan.kind is None or plan.aborted_in is not None or req is None:
        return
    state = _state(req)
    if state == "prefill" and not 0 < req.computed < len(req.prompt):
        return  # admitted, but no chunk has run yet
    if state != plan.kind:
        return
    if plan.seen >= plan.after:
        engine.abort(rid)
        plan.aborted_in = state
    plan.seen += 1


@pytest.mark.parametrize("seed", range(5))
def test_random_aborts_leave_no_leak(oracle: Oracle, seed: int) -> None:
    """Aborts in every state, at random moments: invariants hold every step, pools end free."""
    rng = random.Random(seed)
    engine = oracle.engine(max_total_tokens=512, swa_full_tokens_ratio=0.25, chunked_prefill_size=CHUNK,
                           max_running_requests=4, swa_eviction_interval=4)  # fmt: skip
    plans = _plans(rng)
    rids = {}
    for plan in plans:

        def sink(d: StreamDelta, plan: Plan = plan) -> None:
            plan.got += d.token_ids
            plan.reason = d.finish_reason

        rids[
            engine.add_request(
                plan.prompt, SamplingParams(max_tokens=plan.max_tokens, **GREEDY), on_delta=sink
            )
        ] = plan

    def on_step(_: int) -> None:
        for rid, plan in rids.items():
            _maybe_abort(engine, rid, plan)

    run_checked(engine, on_step)
    assert {p.aborted_in for p in plans} >= set(KINDS), [p.aborted_in for p in plans]
    for i, plan in enumerate(plans):
        want = oracle.greedy(plan.prompt, plan.max_tokens)
        if plan.aborted_in is None:
            assert (plan.got, plan.reason) == (want, "length"), f"request {i}"
        else:
            assert plan.reason == "abort", f"request {i}"
            assert plan.got == want[: len(plan.got)], f"request {i}: tokens before the abort differ"
    assert engine.stats().aborts == sum(p.aborted_in is not None for p in plans)
    assert_all_free(engine)


def test_abort_in_the_inbox_unknown_and_twice(oracle: Oracle) -> None:
    """An abort queued with its add finishes the request at once; unknown or repeated ids are no-ops."""
    engine = oracle.engine()
    deltas: list[StreamDelta] = []
    rid = engine.add_request(
        tokens(20, seed=5), SamplingParams(max_tokens=4, **GREEDY), on_delta=deltas.append
    )
    engine.abort(rid)
    engine.abort("no-such-request")
    engine.step()
    engine.abort(rid)
    run_checked(engine)
    assert [(d.finished, d.finish_reason, d.token_ids) for d in deltas] == [(True, "abort", [])]
    assert engine.stats().aborts == 1
    assert_all_free(engine)


def test_abort_of_a_request_sharing_a_locked_prefix(oracle: Oracle) -> None:
    """Aborting one of two requests that lock the same cached prefix keeps the other exact."""
    engine = oracle.engine(chunked_prefill_size=CHUNK)
    shared = tokens(40, seed=6)
    engine.generate([shared], SamplingParams(max_tokens=2, **GREEDY))
    a, b = shared + tokens(9, seed=7), shared + tokens(11, seed=8)
    got: dict[str, list[int]] = {}
    sink = lambda d: got.setdefault(d.request_id, []).extend(d.token_ids)  # noqa: E731
    ra = engine.add_request(a, SamplingParams(max_tokens=12, **GREEDY), on_delta=sink)
    rb = engine.add_request(b, SamplingParams(max_tokens=12, **GREEDY), on_delta=sink)
    run_checked(engine, lambda i: engine.abort(ra) if i == 2 else None)
    assert got[rb] == oracle.greedy(b, 12)
    assert got[ra] == oracle.greedy(a, 12)[: len(got[ra])] and len(got[ra]) < 12
    assert_all_free(engine)


# ---- requests that can never run --------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "overrides", "words"),
    [
        (10, 30, dict(max_model_len=32), "context of 32 tokens"),
        (4000, 200, {}, "context of 4096 tokens"),
        (100, 100, dict(max_total_tokens=128), "KV pool holds 128"),
        (0, 4, {}, "prompt is empty"),
    ],
    ids=["over_max_model_len", "over_model_context", "over_pool", "empty"],
)
def test_a_request_that_can_never_fit_is_refused(
    oracle: Oracle, prompt_len: int, max_tokens: int, overrides: dict, words: str
) -> None:
    """validate() (and add_request / generate through it) raise a ValueError saying what to change."""
    engine = oracle.engine(**overrides)
    prompt, params = [3] * prompt_len, SamplingParams(max_tokens=max_tokens, **GREEDY)
    for call in (lambda: engine.validate(prompt, params), lambda: engine.add_request(prompt, params),
                 lambda: engine.generate([prompt], params)):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            call()
    assert not engine.has_work()
    assert_all_free(engine)


def test_out_of_vocab_prompt_is_refused(oracle: Oracle) -> None:
    """Token ids outside the vocabulary are refused with the valid range."""
    engine = oracle.engine()
    for bad in ([1, 128], [-1, 2], [1, 2.0]):
        with pytest.raises(ValueError, match=r"\[0, 128\)"):
            engine.add_request(bad, SamplingParams(max_tokens=2))  # type: ignore[arg-type]
    assert not engine.has_work()


def test_largest_request_that_fits_runs(oracle: Oracle) -> None:
    """The boundary validate() draws is tight enough: a request just inside it completes."""
    engine = oracle.engine(
        max_total_tokens=128, swa_full_tokens_ratio=0.5, chunked_prefill_size=CHUNK
    )
    P = engine.config.page_size
    prompt_len, max_tokens = 128 - 2 * P - 8, 8  # need = ceil_P(n + max) + P = 124 <= 128
    prompt = tokens(prompt_len, seed=9)
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    engine.validate(prompt, params)
    got: list[int] = []
    engine.add_request(prompt, params, on_delta=lambda d: got.extend(d.token_ids))
    run_checked(engine)
    assert got == oracle.greedy(prompt, max_tokens)
    assert_all_free(engine)


def test_duplicate_request_ids_are_refused_without_failing_the_step(oracle: Oracle) -> None:
    """A duplicate id is refused at add time; two adds racing into the same step refuse only the
    second (through its own stream), and the first runs to an exact result."""
    engine = oracle.engine()
    prompt, params = tokens(20, seed=10), SamplingParams(max_tokens=6, **GREEDY)
    first: list[StreamDelta] = []
    second: list[StreamDelta] = []
    engine.add_request(prompt, params, request_id="x", on_delta=first.append)
    engine.add_request(prompt, params, request_id="x", on_delta=second.append)  # both in the inbox
    engine.step()
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        engine.add_request(prompt, params, request_id="x")
    run_checked(engine)
    assert [(d.finished, d.finish_reason, d.error) for d in second] == [
        (True, "abort", "duplicate request id 'x'")
    ]
    assert [t for d in first for t in d.token_ids] == oracle.greedy(prompt, 6)
    assert first[-1].finish_reason == "length"
    assert_all_free(engine)
