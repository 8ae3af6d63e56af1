"""Where a py-spy profile's samples go: the worker's engine step by part, any process by file.

Input is py-spy's ``raw`` format recorded with ``--threads`` (one line per distinct stack:
``thread (TID): NAME;frame;frame;... COUNT``, each frame ``function (file:line)``, root first).
A sample belongs to the first part that matches its frames read from the leaf up, so time
inside `F.linear` called from the attention block counts as Linear, and the attention backend's
own tensor work as attention.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO_PREFIX = str(Path(__file__).resolve().parents[2]) + "/"  # this checkout, as py-spy prints it
ENGINE_THREAD = "swaserve-engine"  # worker.hosts.async_engine's step thread
# (part, substring of a frame) in the order a frame is tested
ENGINE_PARTS = (
    ("linear", "torch/nn/modules/linear.py"),
    ("attention", "/worker/attention/"),
    ("attention", "PagedAttention."),
    ("norm", "RMSNorm."),
    ("rope", "/worker/models/rope.py"),
    ("model other", "/worker/models/"),
    ("sampling", "/worker/runner/sampler.py"),
    ("sampling", "/worker/runner/logit_controls.py"),
    ("host prep", "/worker/runner/"),
    ("host prep", "/worker/kv/"),
    ("radix cache", "/worker/cache/"),
    ("scheduler", "/worker/scheduler/"),
    ("engine other", "/worker/"),
)


@dataclass(frozen=True)
class Stack:
    thread: str
    frames: tuple[str, ...]  # root first
    count: int


def parse_raw(text: str) -> list[Stack]:
    """py-spy ``--format raw --threads`` output → stacks (lines that do not parse are skipped)."""
    out = []
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        parts = head.split(";")
        if parts[0].startswith("thread ("):  # "thread (TID)" or "thread (TID): NAME"
            thread, frames = parts[0].partition("): ")[2], parts[1:]
        else:
            thread, frames = "", parts
        out.append(Stack(thread, tuple(frames), int(count)))
    return out


def engine_part(frames: Iterable[str]) -> str:
    """The engine part a stack's time belongs to (leaf-most frame that matches a part)."""
    for frame in reversed(tuple(frames)):
        for part, needle in ENGINE_PARTS:
            if needle in frame:
                return part
    return "engine other"


@dataclass(frozen=True)
class WorkerBreakdown:
    samples: int  # every sample of the process (py-spy leaves idle threads out by default)
    engine_samples: int
    parts: dict[str, int]  # engine part → samples

    @property
    def engine_share(self) -> float:
        return self.engine_samples / self.samples if self.samples else 0.0

    def share(self, part: str) -> float:
        """`part`'s samples over all of the process's samples."""
        return self.parts.get(part, 0) / self.samples if self.samples else 0.0


def worker_breakdown(stacks: Iterable[Stack]) -> WorkerBreakdown:
    parts: Counter[str] = Counter()
    total = engine = 0
    for s in stacks:
        total += s.count
        if s.thread == ENGINE_THREAD:
            engine += s.count
            parts[engine_part(s.frames)] += s.count
    return WorkerBreakdown(total, engine, dict(parts.most_common()))


def file_of(frame: str) -> str:
    """``function (path:line)`` → the path relative to this checkout, site-packages or the
    standard library (``deploy/openai/choices.py``, ``ray/serve/...``, ``asyncio/events.py``)."""
    path = frame.rpartition(" (")[2].rstrip(")").rpartition(":")[0]
    if path.startswith(REPO_PREFIX):
        return path[len(REPO_PREFIX) :]
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail if marker == "site-packages/" else tail.split("/", 1)[-1]
    return path


def by_file(stacks: Iterable[Stack], *, inclusive: bool, prefix: str = "") -> Counter[str]:
    """Samples per source file: the leaf frame's file (self time), or every file on the stack
    counted once (inclusive time), keeping only files starting with `prefix`."""
    counts: Counter[str] = Counter()
    for s in stacks:
        if not s.frames:
            continue
        files = {file_of(f) for f in s.frames} if inclusive else {file_of(s.frames[-1])}
        for f in files:
            if f.startswith(prefix):
                counts[f] += s.count
    return counts
