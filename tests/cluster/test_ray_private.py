"""Every Ray internal `cluster.ray_private` (swaserve) and `tests.serve_internals` (the tests)
use still exists with the shape it relies on.

No cluster needed: these fail first, and by name, when a Ray upgrade moves an internal.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import ray
from ray import serve
from ray.serve.request_router import RequestRouter

from cluster import ray_private
from tests import serve_internals


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_ray_version_is_the_pinned_one() -> None:
    """The internals below were checked against Ray 2.60.0 (pyproject pins it)."""
    assert ray.__version__ == "2.60.0"


def test_cluster_switch_is_the_constant_node_ip_lookup_reads() -> None:
    """`ENABLE_RAY_CLUSTER` is a bool that `services.get_node_ip_address` still consults."""
    from ray._private import ray_constants, services

    before = ray_constants.ENABLE_RAY_CLUSTER
    assert isinstance(before, bool)
    assert "ray_constants.ENABLE_RAY_CLUSTER" in inspect.getsource(services.get_node_ip_address)
    try:
        ray_private.set_clusters_enabled(not before)
        assert ray_constants.ENABLE_RAY_CLUSTER is (not before)
    finally:
        ray_private.set_clusters_enabled(before)


def test_init_still_takes_the_underscore_node_arguments() -> None:
    """`ray.init` still pops `_node_ip_address` and `_temp_dir` from its keyword arguments."""
    source = inspect.getsource(ray.init)
    for name in ray_private.loopback_init_kwargs("/tmp/x"):
        assert f'kwargs.pop("{name}"' in source, name



def test_handles_still_switch_data_planes_by_reference() -> None:
    """`DeploymentHandle.options` takes `_by_reference`, a False one sends the call over gRPC
    (the request metadata field the router reads), and every replica starts the
    inter-deployment gRPC server whatever its callers use."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.replica import Replica
    from ray.serve.handle import DeploymentHandle

    assert {"_by_reference", "response_serialization"} <= set(_params(DeploymentHandle.options))
    assert "_by_reference" in {f.name for f in dataclasses.fields(RequestMetadata)}
    assert "_by_reference=False" in inspect.getsource(ray_private.grpc_stream_handle)
    started = inspect.getsource(Replica._on_initialized)
    assert "add_ASGIServiceServicer_to_server" in started and "_internal_grpc_port" in started


def test_a_handle_router_can_still_run_on_the_calling_loop() -> None:
    """`_init` takes `_run_router_in_separate_loop` (an init option, so it is set before the
    first call), and False makes a router bound to the running loop."""
    from ray.serve._private import default_impl
    from ray.serve._private.handle_options import InitHandleOptions
    from ray.serve.handle import DeploymentHandle

    assert "_run_router_in_separate_loop" in {f.name for f in dataclasses.fields(InitHandleOptions)}
    assert isinstance(DeploymentHandle.is_initialized, property)
    assert "_init(_run_router_in_separate_loop=False)" in inspect.getsource(ray_private.current_loop_handle)
    source = inspect.getsource(default_impl.create_router)
    assert "handle_options._run_router_in_separate_loop" in source and "CurrentLoopRouter" in source

def test_direct_ingress_still_binds_through_the_function_patched_for_address_reuse() -> None:
    """A direct-ingress replica starts its HTTP server through the `start_asgi_http_server`
    name of the replica module, with `enable_so_reuseport=False` and Serve's app first; after
    the patch that server's socket has SO_REUSEADDR (so a port its closed connections leave in
    TIME_WAIT binds again) and it serves the wrapped app (the last call's wrapper)."""
    import asyncio
    import socket

    from ray.serve._private import replica
    from ray.serve.config import HTTPOptions

    source = inspect.getsource(replica.Replica._maybe_start_direct_ingress_servers)
    assert "start_asgi_http_server(" in source and "enable_so_reuseport=False" in source
    assert "self._direct_ingress_asgi," in source  # the app, positionally
    before = replica.start_asgi_http_server
    replaced: list[object] = []
    wrapped: list[object] = []
    try:
        ray_private.direct_ingress_server(lambda app: replaced.append(app) or app)
        ray_private.direct_ingress_server(lambda app: wrapped.append(app) or app)
        assert replica.start_asgi_http_server is not before

        async def app(scope: dict, receive: object, send: object) -> None:  # never called
            raise AssertionError(scope)

        async def bind() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            loop = asyncio.get_running_loop()
            options = HTTPOptions(host="127.0.0.1", port=port)
            task, server = await replica.start_asgi_http_server(app, options, event_loop=loop)
            try:
                deadline = loop.time() + 30
                while not server.started:
                    assert loop.time() < deadline, "uvicorn did not start"
                    await asyncio.sleep(0.01)  # waits on uvicorn's startup
                (sock,) = server.servers[0].sockets
                return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR))
            finally:
                server.should_exit = True
                await asyncio.wait_for(task, 30)

        assert asyncio.run(bind()) != 0
        assert wrapped == [app] and not replaced
    finally:
        replica.start_asgi_http_server = before


def test_direct_ingress_gives_each_replica_a_port_of_its_own() -> None:
    """Why `swaserve serve` runs one ingress replica (`direct_ingress_server`'s NOTE): each
    direct-ingress replica binds the port the controller allocates it from the range, and a
    range of one port (`direct_ingress_env`) has none left for a second replica, SO_REUSEPORT
    or not."""
    from ray.serve._private import replica
    from ray.serve._private.node_port_manager import NoAvailablePortError, PortAllocator

    source = inspect.getsource(replica.Replica._maybe_start_direct_ingress_servers)
    assert "allocate_replica_port.remote(" in source and "start_server_fn(port)" in source
    ports = PortAllocator(8123, 8124, "HTTP", "node")
    assert ports.allocate("ingress-1") == 8123
    with pytest.raises(NoAvailablePortError):
        ports.allocate("ingress-2")


def test_build_app_and_deployment_config_work_offline() -> None:
    """`build_app(app, name=)` resolves an application's deployments without a cluster, and a
    deployment's `_deployment_config` carries `autoscaling_config`."""

    class Echo:
        def __call__(self) -> str:
            return "hi"

    built = serve_internals.build_app(serve.deployment(Echo).bind(), name="app")
    (deployment,) = built.deployments
    assert deployment.name == "Echo"
    assert serve_internals.deployment_config(deployment).autoscaling_config is None


def test_config_file_deploy_entry_points_keep_their_arguments() -> None:
    """`serve_start(http_options=, proxy_location=)` and `deploy_apps(config, _blocking=)`."""
    from ray.serve._private.api import serve_start
    from ray.serve._private.client import ServeControllerClient

    assert {"http_options", "proxy_location"} <= set(_params(serve_start))
    assert _params(ServeControllerClient.deploy_apps)[:3] == ["self", "config", "_blocking"]
    assert "_blocking=False" in inspect.getsource(serve_internals.deploy_config_file)


def test_routing_loop_entry_point_is_a_coroutine_taking_a_pending_request() -> None:
    """`RequestRouter._choose_replica_for_request(pending_request)` is still async."""
    fn = RequestRouter._choose_replica_for_request
    assert inspect.iscoroutinefunction(fn)
    assert _params(fn)[:2] == ["self", "pending_request"]
    assert "._choose_replica_for_request(pending_request)" in inspect.getsource(serve_internals.route_one)


def test_serve_common_types_build_as_the_router_tests_build_them() -> None:
    """`DeploymentID(name, app_name)`, `DeploymentHandleSource.REPLICA`, `RequestMetadata(...)`."""
    common = serve_internals.serve_common()
    dep = common.DeploymentID(name="Worker", app_name="app")
    assert (dep.name, dep.app_name) == ("Worker", "app")
    assert common.DeploymentHandleSource.REPLICA.value == "REPLICA"
    meta = common.RequestMetadata(request_id="r", internal_request_id="r")
    assert meta.internal_request_id == "r"


def test_own_request_id_gives_each_call_a_fresh_internal_id() -> None:
    """Inside `own_request_id`, Serve's request metadata gets a new internal id; after, the
    request context is back as it was."""
    from ray.serve import context
    from ray.serve._private.default_impl import get_request_metadata
    from ray.serve._private.handle_options import DynamicHandleOptions, InitHandleOptions

    context._set_request_context(request_id="http-1", _internal_request_id="shared")

    ids = []
    for _ in range(2):
        with ray_private.own_request_id():
            meta = get_request_metadata(InitHandleOptions.create(), DynamicHandleOptions())
            ids.append(meta.internal_request_id)
            assert meta.request_id == "http-1"
    assert len(set(ids)) == 2 and "shared" not in ids
    assert context._get_serve_request_context()._internal_request_id == "shared"
    context._unset_request_context()
