"""ServeWorkerClient.stream: a request is sent again while no token came back, but not to a third
replica after two engines died running it (no Ray: each attempt is scripted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.messages import EngineDiedError, RoutedRequest, StreamStart, WorkerUnavailableError
from core.outputs import StreamDelta
from deploy.replica.client import RETRIES, DeathRecord, ServeWorkerClient
from router import routing_record


class _Handle:
    app_name, deployment_name = "app", "Worker"

    def options(self, **_: Any) -> _Handle:
        return self


def _delta(tokens: list[int], finished: bool = False) -> StreamDelta:
    return StreamDelta("r", tokens, finished, "length" if finished else None, 3, 0, len(tokens))


def _client(attempts: list[list[Any]]) -> tuple[ServeWorkerClient, list[RoutedRequest]]:
    """Each attempt yields its items in order; an exception item is raised there."""
    client = ServeWorkerClient(_Handle())  # type: ignore[arg-type]
    sent: list[RoutedRequest] = []

    async def attempt(request: RoutedRequest) -> AsyncIterator[Any]:
        items = attempts[len(sent)]
        sent.append(request)
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item

    client._attempt = attempt  # type: ignore[method-assign]
    return client, sent


def _run(client: ServeWorkerClient, request_id: str = "r", deaths: DeathRecord | None = None) -> list[Any]:
    async def go() -> list[Any]:
        return [item async for item in client.stream(RoutedRequest([1, 2, 3], request_id), deaths)]

    return asyncio.run(go())


def test_a_replica_dead_before_the_first_token_is_avoided_on_the_retry() -> None:
    """The caller sees only the replica that served, and the retry ranks the dead one last."""
    done = _delta([7, 8], finished=True)
    client, sent = _client([[StreamStart("a"), ActorDiedError()], [StreamStart("b"), done]])
    assert _run(client) == [StreamStart("b"), done]
    assert [r.avoid for r in sent] == [(), ("a",)]


def test_a_refusal_while_shutting_down_is_retried_elsewhere() -> None:
    refusal = StreamStart("a", "unavailable", "worker replica is shutting down; retry")
    done = _delta([5], finished=True)
    client, sent = _client([[refusal], [StreamStart("b"), done]])
    assert _run(client) == [StreamStart("b"), done] and sent[1].avoid == ("a",)


def test_dying_before_any_item_is_retried_too() -> None:
    """No StreamStart names the replica: the retry ranks last the one the router placed it on
    (a node gone: every call to it fails until the controller notices)."""
    done = _delta([5], finished=True)
    client, sent = _client([[ActorUnavailableError("node gone", None)], [StreamStart("b"), done]])
    routing_record.note_placed("r", routing_record.Placement("a", "swa_prefix"))
    assert _run(client) == [StreamStart("b"), done] and sent[1].avoid == ("a",)


def test_dying_before_any_item_unplaced_is_retried_without_avoid() -> None:
    done = _delta([5], finished=True)
    client, sent = _client([[ActorDiedError()], [StreamStart("b"), done]])
    assert _run(client, "unplaced") == [StreamStart("b"), done] and sent[1].avoid == ()


def test_after_the_first_token_the_error_reaches_the_caller() -> None:
    client, sent = _client([[StreamStart("a"), _delta([1]), ActorDiedError()]])
    with pytest.raises(ActorDiedError):
        _run(client)
    assert len(sent) == 1


def test_other_errors_and_the_last_attempt_are_not_retried() -> None:
    client, sent = _client([[StreamStart("a"), ValueError("bad")]])
    with pytest.raises(ValueError):
        _run(client)
    assert len(sent) == 1
    client, sent = _client([[StreamStart(w), WorkerUnavailableError(w)] for w in "abc"])
    with pytest.raises(WorkerUnavailableError):
        _run(client)
    assert len(sent) == RETRIES + 1 and sent[-1].avoid == ("a", "b")


def test_a_last_refusal_is_passed_on() -> None:
    """Out of retries, the refusal itself goes to the caller (who answers 503)."""
    refusals = [[StreamStart(w, "unavailable", "shutting down")] for w in "abc"]
    client, _ = _client(refusals)
    assert _run(client) == [refusals[-1][0]]


def test_a_request_two_engines_died_running_is_not_sent_a_third_time() -> None:
    """Engines dying under the request before its first token: sent once more, then raised (the
    ingress answers 503), never to a third replica."""
    client, sent = _client([[StreamStart(w), EngineDiedError(w)] for w in "abc"])
    deaths = DeathRecord()
    with pytest.raises(EngineDiedError):
        _run(client, deaths=deaths)
    assert len(sent) == 2 and sent[1].avoid == ("a",) and deaths.replicas == {"a", "b"}


def test_a_replica_process_lost_counts_as_a_death_too() -> None:
    client, sent = _client([[StreamStart("a"), ActorDiedError()], [StreamStart("b"), ActorDiedError()],
                            [StreamStart("c"), _delta([1], finished=True)]])  # fmt: skip
    with pytest.raises(ActorDiedError):
        _run(client)
    assert len(sent) == 2


def test_deaths_the_service_saw_before_count_against_the_resend() -> None:
    """The record is the HTTP request's: after a restart that followed one death (the service
    noted it), a death before the first token is the second, and is raised at once."""
    client, sent = _client([[StreamStart("b"), EngineDiedError("b")], [StreamStart("c"), _delta([1], finished=True)]])
    deaths = DeathRecord({"a"})
    with pytest.raises(EngineDiedError):
        _run(client, deaths=deaths)
    assert len(sent) == 1


def test_the_same_replica_dying_under_two_prompts_is_one_death() -> None:
    """Two prompts of one request on one replica whose engine died: one replica, one death."""
    deaths = DeathRecord()
    assert deaths.note("a") and deaths.note("a") and not deaths.note("b")


def test_an_engine_death_raised_in_a_replica_is_one_at_the_ingress() -> None:
    """What Serve hands the ingress for an exception raised in the replica (a `RayTaskError`
    made an instance of its cause) is still an engine death, and the worker client's test sees it."""
    from ray.exceptions import RayTaskError

    from deploy.replica.client import engine_died

    wrapped = RayTaskError("generate", "traceback", EngineDiedError("w0")).as_instanceof_cause()
    assert engine_died(wrapped) and engine_died(ActorDiedError())
    assert not engine_died(RayTaskError("generate", "tb", WorkerUnavailableError("w0")).as_instanceof_cause())
