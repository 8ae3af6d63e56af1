"""What an error tells the client, and what only the log hears (docs/design.md §4.2).

Every response carries `x-request-id`: the client's own when it sent a usable one (vLLM does the
same; `vllm bench serve` sends one), else one made here. Under Serve its HTTP server (proxy or
direct ingress) sets the header and puts its id (the client's, or a new one) into the request's
headers, where this module reads it; a client id that is not plain is still answered in Serve's
header as sent, while bodies and logs name the one made here. An error body says what the client can
act on and nothing from inside the server: no exception text, no paths, no Ray tracebacks. A
5xx names the request id in its message, and the log line with the details names it too.

| error | the client reads | the log gets |
|---|---|---|
| an `APIError` below 500 (the request's fault) | its message | nothing |
| a generation that ended with an error a client may read (`CLIENT_ERROR_KINDS`) | 400 with that error | nothing |
| any other worker or engine error, an unexpected exception | 500 "internal error", the request id | the exception with its traceback, the request id |
| overload, a replica gone, the deadline (503 / 504) | what to do (retry, ask for less), the request id | one line with the cause |
"""

from __future__ import annotations

import logging
import re
import uuid

from core.outputs import CLIENT_ERROR_KINDS
from deploy.openai.schema import APIError

log = logging.getLogger("swaserve.ingress")

REQUEST_ID_HEADER = "x-request-id"
# A client's id is kept when it is this short and plain: it goes into log lines and headers.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


class GenerationError(Exception):
    """An error a generation ended with on its worker (the text the engine wrote)."""


def request_id(sent: str | None) -> str:
    """The id of one request: the client's `x-request-id` if usable, else a fresh one."""
    if sent and _CLIENT_ID.fullmatch(sent):
        return sent
    return f"req-{uuid.uuid4().hex}"


def generation_failed(error: str) -> APIError:
    """The answer to a generation that ended with `error`: the engine's per-request endings
    written for the client pass (400: the request's constraints left no way on); any other text
    stays in the log (`public`), the client gets a 500."""
    if error.startswith(tuple(f"{kind}: " for kind in CLIENT_ERROR_KINDS)):
        return APIError(400, error, code="generation_failed")
    failure = APIError(500, "internal error while generating", type="server_error")
    failure.__cause__ = GenerationError(error)
    return failure


def internal_error(cause: BaseException) -> APIError:
    """A 500 for an exception nothing mapped (its text is for the log only: `public`)."""
    failure = APIError(500, "internal error", type="server_error")
    failure.__cause__ = cause
    return failure


def public(err: APIError, rid: str) -> APIError:
    """`err` as the client gets it: a 5xx with the request id in its message, logged with its
    cause (a 500 with the traceback); below 500 as it is."""
    if err.status < 500:
        return err
    cause = err.__cause__
    if err.status == 500:
        log.error("request %s failed: %s", rid, err.message,
                  exc_info=(type(cause), cause, cause.__traceback__) if cause else None)  # fmt: skip
    else:
        log.warning("request %s: %d %s (%s)", rid, err.status, err.message, _describe(cause))
    message = f"{err.message} (request id {rid})"
    return APIError(err.status, message, type=err.type, param=err.param, code=err.code, headers=err.headers)


def _describe(cause: BaseException | None) -> str:
    if cause is None:
        return "no cause"
    first = str(cause).strip().splitlines()[:1]
    return f"{type(cause).__name__}: {first[0] if first else ''}"
