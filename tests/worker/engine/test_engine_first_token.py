"""A newcomer's first token is not held behind running requests: a prompt that arrives while
others decode (and fits the step's prefill budget) is prefilled by the very next step, in the
same batch as their decodes, and that step hands out its first token (docs/design.md §11.7)."""

from __future__ import annotations

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from worker.scheduler.request import ReqState


def test_a_prompt_arriving_during_decodes_gets_its_first_token_from_the_next_step(oracle: Oracle) -> None:
    engine = oracle.engine(overlap_schedule="off", chunked_prefill_size=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    running = [engine.add_request(tokens(20, seed=s), params) for s in (1, 2)]
    engine.step()  # admits both (the inbox drains at a step)
    while not all(engine.scheduler.reqs[r].output for r in running):
        engine.step()
        engine.check_integrity()
    assert all(engine.scheduler.reqs[r].is_decoding for r in running)
    newcomer = engine.add_request(tokens(40, seed=3), params)
    deltas = {d.request_id: d for d in engine.step()}
    engine.check_integrity()
    assert engine.scheduler.reqs[newcomer].state is ReqState.RUNNING
    assert len(deltas[newcomer].token_ids) == 1  # its first token, from this step
    assert all(len(deltas[r].token_ids) == 1 for r in running)  # their decodes went on
    run_checked(engine)
    assert_all_free(engine)
