"""`swaserve serve`'s command line without Ray: parsing, config merging, CPU fitting."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deploy import cli
from deploy.serve_local import ServeRequest, check_port_free, plan


def test_serve_flags_parse() -> None:
    """`swaserve serve` takes the documented flags."""
    args = cli.build_parser().parse_args(
        ["serve", "--model", "tiny", "--workers", "2", "--host", "127.0.0.1", "--port", "8011",
         "--routing", "least_loaded", "--config", "x.yaml"]  # fmt: skip
    )
    assert (args.model, args.workers, args.port, args.routing, args.config) == ("tiny", 2, 8011, "least_loaded", "x.yaml")


@pytest.mark.parametrize("bad", [["serve", "--workers", "0"], ["serve", "--port", "70000"], ["serve", "--routing", "random"]])
def test_serve_rejects_bad_flags(bad: list[str]) -> None:
    """Out-of-range flags stop at argparse with exit status 2."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(bad)
    assert e.value.code == 2


def test_plan_merges_config_file_and_flags(tmp_path: Path) -> None:
    """Flags override the file; --workers replaces the file's autoscaling; host/port come from the file."""
    doc = tmp_path / "app.yaml"
    doc.write_text(
        "http_options: {host: 127.0.0.1, port: 8123}\n"
        "applications:\n- name: swaserve\n  route_prefix: /\n  import_path: deploy.app:build_app\n"
        "  args: {model: tiny, page_size: 8, autoscaling: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 4}}\n"
    )
    p = plan(ServeRequest(config=str(doc), workers=2, routing="prefix", num_cpus=2))
    assert (p.host, p.port) == ("127.0.0.1", 8123)
    assert p.config.page_size == 8 and p.config.workers == 2 and p.config.autoscaling is None
    assert p.config.routing == "prefix"
    assert 2 * p.config.worker_num_cpus + 0.25 <= 2  # fractional CPUs fit the 2-CPU cluster


def test_the_ingress_takes_the_port_unless_serve_proxy_is_asked() -> None:
    """By default the ingress replica listens on --port itself (Serve's direct ingress, one
    port for one replica, released ports reusable at once); --serve-proxy leaves the port to
    Serve's proxy and sets none of that."""
    from cluster.ray_local import direct_ingress_env

    direct = plan(ServeRequest(port=8123, num_cpus=2))
    assert direct.direct_ingress_port == 8123
    env = direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8123", "8124")
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    args = cli.build_parser().parse_args(["serve", "--serve-proxy"])
    assert args.serve_proxy and not cli.build_parser().parse_args(["serve"]).serve_proxy
    assert plan(ServeRequest(port=8123, num_cpus=2, serve_proxy=True)).direct_ingress_port is None


def test_more_ingress_replicas_share_the_direct_ingress_port(tmp_path: Path) -> None:
    """ingress_replicas > 1 is planned with or without --serve-proxy, each replica's CPU share
    counted; direct ingress gets a port range of one port per replica, all of them told to bind
    the first; metrics_key from the file survives the merge."""
    doc = tmp_path / "cfg.yaml"
    doc.write_text("model: tiny\ningress_replicas: 3\nmetrics_key: scrape\n")
    for proxy in (False, True):
        p = plan(ServeRequest(config=str(doc), num_cpus=2, port=8123, serve_proxy=proxy))
        assert p.config.ingress_replicas == 3 and p.config.metrics_key.get_secret_value() == "scrape"
        assert p.config.worker_num_cpus + 3 * 0.25 <= 2
        assert p.direct_ingress_port == (None if proxy else 8123)
    from cluster.ray_local import direct_ingress_env
    from cluster.ray_private import SHARED_INGRESS_PORT_ENV

    env = direct_ingress_env(8123, replicas=3)
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8123", "8126")
    assert env[SHARED_INGRESS_PORT_ENV] == "8123"


def test_plan_refuses_workers_that_cannot_fit(tmp_path: Path) -> None:
    """Explicit worker CPUs beyond the cluster are refused before anything starts."""
    doc = tmp_path / "cfg.yaml"
    doc.write_text("model: tiny\nworker_num_cpus: 1\n")
    with pytest.raises(ValueError, match="need .* CPUs"):
        plan(ServeRequest(config=str(doc), workers=2, num_cpus=2))
    ok = plan(ServeRequest(workers=3, num_cpus=2))
    assert ok.config.worker_num_cpus * 3 + 0.25 <= 2


def test_plan_fits_every_tensor_parallel_rank(tmp_path: Path) -> None:
    """local-tp.yaml fits 2 CPUs; without explicit CPUs each rank gets a share of the machine."""
    local_tp = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "local-tp.yaml"
    p = plan(ServeRequest(config=str(local_tp), num_cpus=2))
    assert p.config.tensor_parallel_size == 2
    doc = tmp_path / "tp.yaml"
    doc.write_text("model: tiny\ntensor_parallel_size: 2\nworkers: 2\n")
    cfg = plan(ServeRequest(config=str(doc), num_cpus=2)).config
    assert 2 * (cfg.worker_num_cpus + cfg.rank_num_cpus) + 0.25 <= 2


def test_port_in_use_is_reported() -> None:
    """A busy port is an error that names the port and the flag to change."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}.*--port"):
            check_port_free("127.0.0.1", port)


def test_a_port_left_in_time_wait_is_free() -> None:
    """A server stopped a moment ago leaves its closed connections in TIME_WAIT; the HTTP
    listener binds with SO_REUSEADDR, so the check must not call that port busy."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end of the connection is in TIME_WAIT
        cli.close()
    check_port_free("127.0.0.1", port)


def test_cuda_device_asks_for_one_gpu_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda reserves a GPU per worker and refuses more workers than GPUs."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    p = plan(ServeRequest(device="cuda", workers=2, num_cpus=16))
    assert p.config.device == "cuda" and p.config.worker_num_gpus == 1
    with pytest.raises(ValueError, match="need 3 GPUs"):
        plan(ServeRequest(device="cuda", workers=3, num_cpus=16))
