"""Every use of a Ray internal (a `_private` module, an underscore name or argument) by swaserve,
each with the reason no public API does the job. Nothing else in swaserve touches one, and the
tests only through `tests/serve_internals.py` (tests/test_architecture.py checks);
tests/cluster/test_ray_private.py checks without a cluster that each name here and there still
exists with the shape used, so a Ray upgrade that moves one fails there, loudly, before anything
else. Ray is pinned (2.60.0).

Ray is imported inside each function: importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any


def set_clusters_enabled(enabled: bool) -> None:
    """Set `ray._private.ray_constants.ENABLE_RAY_CLUSTER`.

    Why private: Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` once, when it is imported, into
    this constant; with it True (Linux), `ray.init(_node_ip_address="127.0.0.1")` swaps the
    loopback address for the host's routable one. No public switch keeps a loopback cluster
    on 127.0.0.1 once Ray is imported.
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = enabled


def loopback_init_kwargs(temp_dir: str) -> dict[str, Any]:
    """`ray.init` arguments for a loopback node with its own session directory.

    Why private: `ray.init` documents `_node_ip_address` and `_temp_dir` only as underscore
    keyword arguments; the public spellings exist for `ray start` (the CLI) alone, and a
    short per-cluster temp dir is what keeps Ray's socket paths under ~107 bytes and parallel
    jobs apart.
    """
    return {"_node_ip_address": "127.0.0.1", "_temp_dir": temp_dir}


@contextlib.contextmanager
def own_request_id() -> Iterator[None]:
    """Within the block, handle calls get a fresh Serve internal request id (the
    `_internal_request_id` of the contextvar `ray.serve.context._serve_request_context`).

    Why private: a handle call made while serving an HTTP request inherits that request's
    internal id, and Serve's request router indexes pending requests by it, skipping a second
    one with the same id as a "retry": of several worker calls one HTTP request makes at once
    (a batch of prompts), all but the first then wait forever. No public API sets the id of a
    handle call (`.options()` has no such field).
    """
    from ray.serve import context
    from ray.serve._private.utils import generate_request_id

    current = context._get_serve_request_context()
    var: Any = context._serve_request_context  # typed ContextVar[None] by its default
    token = var.set(dataclasses.replace(current, _internal_request_id=generate_request_id()))
    try:
        yield
    finally:
        var.reset(token)



def current_loop_handle(handle: Any) -> Any:
    """`handle._init(_run_router_in_separate_loop=False)`: the handle's router runs on the
    calling event loop instead of Serve's singleton router thread. Call it on the loop that will
    use the handle, before its first `.options()` or `.remote()`; a handle already initialized
    is returned as it is.

    Why private: `_init` and the option are underscore names; the public switch is the
    process-wide `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`, which breaks every handle used
    outside an event loop (the driver's own calls, `swaserve serve`'s drain). With the router on
    its own thread, every streamed item crosses from that loop to the caller's through a queue
    and a thread-safe callback (that thread alone was ~6 % of the ingress's CPU, streaming).
    """
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=False)
    return handle


def grpc_stream_handle(handle: Any, method_name: str) -> Any:
    """`handle.options(stream=True, method_name=..., _by_reference=False)`: a streaming handle
    whose items travel over the replica's gRPC server instead of Ray's object references, each
    pickled with the standard library (`response_serialization="pickle"`, a public option: the
    items are plain module-level dataclasses, and cloudpickle costs the worker ~10x more per
    item).

    Why private: `_by_reference` is the only per-handle switch between Serve's two data planes
    (the public one is the process-wide `RAY_SERVE_USE_GRPC_BY_DEFAULT`, which would also move
    every control call of the driver). By reference, each streamed item is an object the
    caller's core worker receives, stores and resolves on its own threads; a token stream pays
    that once per token (docs/design.md §4.2, the ingress's CPU). Every Serve replica runs the
    inter-deployment gRPC server whichever the callers use (`Replica._on_initialized`), and a
    replica that dies shows as `ActorUnavailableError` (a `RayActorError`) either way.
    """
    return handle.options(
        stream=True, method_name=method_name, _by_reference=False, response_serialization="pickle"
    )


# Set by `swaserve serve` (`cluster.ray_local.direct_ingress_env`): the one port every
# direct-ingress replica of the cluster binds, whatever port Serve allocated it.
SHARED_INGRESS_PORT_ENV = "SWASERVE_SHARED_INGRESS_PORT"


def direct_ingress_server(wrap_app: Callable[[Any], Any]) -> None:
    """In this process, Serve's direct-ingress HTTP server binds its port with SO_REUSEADDR
    (and SO_REUSEPORT), as Serve's own HTTP proxy does (`SOCKET_REUSE_PORT_ENABLED`, on by
    default), and serves `wrap_app(app)` instead of Serve's app; with `SHARED_INGRESS_PORT_ENV`
    set, it binds that port rather than the one Serve allocated the replica.

    Why private: a direct-ingress replica binds through `start_asgi_http_server(...,
    enable_so_reuseport=False)` (`Replica._maybe_start_direct_ingress_servers`), a bare socket.
    Every connection that replica closed then leaves a TIME_WAIT socket that blocks any later
    bind of the port for a minute: a restarted `swaserve serve`, or the replica Serve starts
    in place of a dead ingress replica. And the app that server runs is Serve's
    (`Replica._direct_ingress_asgi`), whose writes to the client are the ones that wait on a
    slow reader (the user code's only queue messages for it): a bound on those writes has to
    wrap that app. No option reaches that socket or that app; this swaps the function the
    replica module calls for one that passes `enable_so_reuseport=True` and the wrapped app.
    The ingress replica calls it in its constructor, which Serve runs before it starts the
    server; a second call replaces the first's wrapper.

    The shared port: Serve's controller gives each direct-ingress replica a port of its own
    from `[RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, ..._MAX_HTTP_PORT)` (`PortAllocator`), and
    no option makes two replicas one port. With SO_REUSEPORT on every replica's socket the
    kernel lets them all bind the same port and spreads new connections over them (a hash of
    the connection's addresses), so N ingress replicas serve one port with no proxy in front:
    `swaserve serve` sets the range to N ports (each replica still gets one; it is left
    unbound) and `SHARED_INGRESS_PORT_ENV` to the port they all bind (docs/design.md §4.2).
    """
    import functools
    import os

    from ray.serve._private import http_util, replica

    original = http_util.start_asgi_http_server
    shared = os.environ.get(SHARED_INGRESS_PORT_ENV)

    @functools.wraps(original)
    async def start(app: Any, http_options: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["enable_so_reuseport"] = True
        if shared:
            http_options = http_options.model_copy(update={"port": int(shared)})
        return await original(wrap_app(app), http_options, *args, **kwargs)

    replica.start_asgi_http_server = start
