"""The Ray Serve internals only the tests use, each with the reason no public API does the job:
resolving an application's deployments without a cluster, deploying a config file as KubeRay
does, Serve's own routing loop and the types a router is built from. The tests reach Ray
internals only here (tests/test_architecture.py checks); tests/cluster/test_ray_private.py
checks offline that each still has the shape used. Swaserve's own are in `cluster/ray_private.py`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def build_app(app: Any, name: str) -> Any:
    """`ray.serve._private.build_app.build_app`: the deployments of an application, resolved
    as Serve would deploy them, without a cluster (tests/deploy/test_config_serves.py).

    Why private: the only public way to see the built deployments is to deploy them.
    """
    from ray.serve._private.build_app import build_app as serve_build_app

    return serve_build_app(app, name=name)


def deployment_config(deployment: Any) -> Any:
    """A `Deployment`'s `DeploymentConfig` (`_deployment_config`), for its autoscaling config.

    Why private: `Deployment` has public properties for replicas, queue limits and actor options
    but none for `autoscaling_config`.
    """
    return deployment._deployment_config


def deploy_config_file(doc: dict[str, Any]) -> None:
    """Deploy a Ray Serve config file (`ServeDeploySchema`) the way `serve deploy` and KubeRay
    do: start Serve with its HTTP options, then the controller's `deploy_apps`, without waiting
    (Serve's own wait gives up after 60 s, too short on a busy machine: poll `serve.status()`).

    Why private: the public route for a config file is the dashboard's REST API (`serve deploy`),
    and the test cluster runs without a dashboard; `serve.run` takes applications, not files.
    """
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    client = serve_start(http_options=doc["http_options"], proxy_location=doc["proxy_location"])
    client.deploy_apps(ServeDeploySchema.model_validate(doc), _blocking=False)


async def route_one(router: Any, pending_request: Any) -> Any:
    """Serve's own routing loop for one request (`RequestRouter._choose_replica_for_request`):
    backoff, rank by rank, skipping replicas at `max_ongoing_requests`.

    Why private: the public hook is `choose_replicas` (our ranking); the loop that consumes its
    ranks only runs inside a `DeploymentHandle`, i.e. on a cluster.
    """
    return await router._choose_replica_for_request(pending_request)


def serve_common() -> ModuleType:
    """`ray.serve._private.common`, for `DeploymentID`, `DeploymentHandleSource` and
    `RequestMetadata`: what a `RequestRouter` and a `PendingRequest` are built from.

    Why private: Serve builds these itself; only `ReplicaID` and `PendingRequest` are re-exported
    publicly (`ray.serve.request_router`), and a router test without a cluster must build them.
    """
    from ray.serve._private import common

    return common
