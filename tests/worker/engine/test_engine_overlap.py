"""Overlap scheduling (docs/design.md §11.8): tokens are processed one step late, yet every
request ends exactly where it would without overlap (no extra token on stop, max_tokens or
abort), seeded sampling, penalties, min_tokens and grammars give the same tokens, and the step
budget (§11.7) never stalls a decode. The parity, stop, abort, retraction and property suites
run with overlap off and on too (their `overlap` fixture)."""

from __future__ import annotations

import pytest

from core.outputs import StreamDelta
from core.sampling_params import Grammar, SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from worker.config import EngineConfig
from worker.engine.engine import Engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_tokens_arrive_one_step_late_with_overlap(oracle: Oracle) -> None:
    """Off: the step that feeds the prompt returns its first token. On: the next step does
    (the first one only launched the forward), and the outputs are the same."""
    prompt = tokens(20, seed=700)
    first: dict[str, int] = {}
    for mode in ("off", "on"):
        engine = oracle.engine(overlap_schedule=mode)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=6, **GREEDY))
        got: list[int] = []
        for i in range(20):
            new = [t for d in engine.step() for t in d.token_ids]
            if new and not got:
                first[mode] = i
            got += new
            if not engine.has_work():
                break
        assert got == oracle.greedy(prompt, 6), (mode, rid)
        assert_all_free(engine)
    assert (first["off"], first["on"]) == (0, 1)


def test_finishes_emit_no_extra_token(oracle: Oracle) -> None:
    """Mixed max_tokens and stop ids in one batch: the same tokens and reasons as without
    overlap, and the engine counts exactly the tokens it handed out."""
    prompts = [tokens(n, seed=710 + n) for n in (5, 30, 70, 12)]
    greedy = [oracle.greedy(p, 12) for p in prompts]
    params = [
        SamplingParams(max_tokens=1, **GREEDY),
        SamplingParams(max_tokens=12, stop_token_ids=[greedy[1][4]], **GREEDY),
        SamplingParams(max_tokens=7, **GREEDY),
        SamplingParams(max_tokens=12, **GREEDY),
    ]
    results = {}
    for mode in ("off", "on"):
        engine = oracle.engine(overlap_schedule=mode)
        outs = engine.generate(prompts, params)
        results[mode] = [(o.token_ids, o.finish_reason) for o in outs]
        assert engine.stats().generated_tokens == sum(len(o.token_ids) for o in outs)
        assert_all_free(engine)
    assert results["on"] == results["off"]
    assert results["off"][1] == (greedy[1][: greedy[1].index(greedy[1][4]) + 1], "stop")


@pytest.mark.parametrize("abort_step", [1, 2, 5])
def test_abort_with_a_step_in_flight_is_final(oracle: Oracle, abort_step: int) -> None:
    """An abort while its next token is being computed: the abort delta is the request's last,
    what it emitted is a prefix of greedy, the others are unaffected, nothing leaks."""
    engine = oracle.engine(overlap_schedule="on", chunked_prefill_size=16)
    prompts = [tokens(24, seed=720), tokens(40, seed=721)]
    seen: dict[str, list[StreamDelta]] = {}
    rids = [
        engine.add_request(p, SamplingParams(max_tokens=10, **GREEDY), on_delta=seen.setdefault(f"r{i}", []).append, request_id=f"r{i}")
        for i, p in enumerate(prompts)
    ]  # fmt: skip

    def on_step(i: int) -> None:
        if i == abort_step:
            engine.abort(rids[0])

    run_checked(engine, on_step)
    aborted, other = seen["r0"], seen["r1"]
    assert aborted[-1].finished and aborted[-1].finish_reason == "abort"
    assert sum(d.finished for d in aborted) == 1
    emitted = [t for d in aborted for t in d.token_ids]
    assert emitted == oracle.greedy(prompts[0], 10)[: len(emitted)] and len(emitted) < 10
    assert [t for d in other for t in d.token_ids] == oracle.greedy(prompts[1], 10)
    assert_all_free(engine)


def test_penalties_seeds_min_tokens_and_grammars_are_exact_with_overlap() -> None:
    """The rows that read earlier tokens (penalties, grammar masks) or count them (seeded
    noise, min_tokens) sample the same tokens with overlap on as off, in one mixed batch."""
    prompt = [17, 230, 45, 99, 512, 8, 77]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=4, min_tokens=10, repetition_penalty=1.5),
        SamplingParams(max_tokens=32, temperature=0.8, seed=5, grammar=Grammar("regex", r"[a-c]{2,6}-\d")),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]  # fmt: skip
    outs = {}
    for mode in ("off", "on"):
        engine = Engine(EngineConfig(model="tiny", max_total_tokens=4096, overlap_schedule=mode))
        outs[mode] = [(o.token_ids, o.finish_reason) for o in engine.generate([prompt] * 5, params)]
        engine.close()
    assert outs["on"] == outs["off"]


def test_the_step_budget_counts_decodes_and_never_stalls_them(oracle: Oracle) -> None:
    """max_num_batched_tokens: every decoding request feeds its token each step, prefill
    chunks fill the rest of the budget, never more; greedy parity holds."""
    budget = 24
    engine = oracle.engine(max_num_batched_tokens=budget, chunked_prefill_size=None, max_running_requests=4)
    prompts = [tokens(n, seed=730 + n) for n in (10, 60, 90, 45)]
    schedule, steps = engine.scheduler.schedule, []

    def recording() -> list:
        decoding = {r.rid for r in engine.scheduler.running if r.is_decoding}
        work = schedule()
        steps.append((decoding, {w.req.rid for w in work if w.decode}, sum(w.n for w in work)))
        return work

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.token_ids for o in outs] == [oracle.greedy(p, 8) for p in prompts]
    assert all(before <= decoded and fed <= budget for before, decoded, fed in steps)
    assert any(fed == budget and decoded for _, decoded, fed in steps)  # a mixed step, full
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        oracle.engine(max_num_batched_tokens=3, max_running_requests=4)
