"""`cluster-compare`'s request streams: `bench.routing.workloads` as text prompts for the 46M model.

The workloads draw token ids from the simulator's vocabulary; here each id becomes one of the
model's tokens that decode to printable ASCII (`parity.plain_token_ids`), and a prompt is the
text those tokens decode to. Text, not ids, because Ray Serve LLM's `PrefixCacheAffinityRouter`
matches prompt text (an id list reads as empty to it); both stacks tokenize the same text with
the same tokenizer. Since every piece decodes to whole ASCII characters, a prompt that extends
another in ids extends it in text, so the workloads' prefix sharing survives.

Closed loops (multi-turn chats, agent branches, long agents) continue from the model's real
answer: a follow-up's text is its parent's text + the answer's text + the new turn's text, and
the workload sees the answer as the answer's token ids (their count is what it uses). A trailing
U+FFFD is left out of the answer (vLLM drops an incomplete last character that swaserve shows as
U+FFFD, `parity.py`), so two stacks whose greedy tokens agree send byte-identical streams.

Sizes fit the model's 4,096 positions: `agent_branching`'s trunks are halved (768-1,536 tokens)
and `long_agent` grows sessions from 512-1,024 to at most 3,584 tokens through 128-512-token tool
results, one session per replica at a time. `scale` is the workloads' requests per replica (for
`long_agent`, sessions per replica); `size_stream` picks it so the stream's distinct prompt
tokens reach a target.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.routing.workloads import (
    AgentBranching,
    LongAgent,
    MultiTenant,
    MultiTurn,
    SimRequest,
    Workload,
    WorkloadSize,
)

STREAM_WORKLOADS = ("multi_tenant", "multi_turn", "agent_branching", "long_agent")
_REPLACEMENT = "\ufffd"


def make_workload(name: str, scale: float, seed: int, replicas: int) -> Workload:
    """A fresh `name` workload (its closed-loop state starts empty) of `scale`."""
    size = WorkloadSize(workers=replicas, requests_per_worker=max(1, round(scale)), seed=seed)
    builders: dict[str, Callable[[], Workload]] = {
        "multi_tenant": lambda: MultiTenant(size),
        "multi_turn": lambda: MultiTurn(size),
        "agent_branching": lambda: AgentBranching(size, trunk_tokens=(768, 1536)),
        "long_agent": lambda: LongAgent(
            size, sessions_per_worker=scale, concurrent_per_worker=1.0, start_tokens=(512, 1024),
            end_tokens=3584, tool_tokens=(128, 512), max_tokens=32,
        ),  # fmt: skip
    }
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {list(builders)}")
    return builders[name]()


@dataclass(frozen=True)
class StreamRequest:
    """One request of a stream: the workload's request and the text sent for it."""

    sim: SimRequest
    text: str

    @property
    def rid(self) -> str:
        return self.sim.rid


class TextCodec:
    """Simulator token ids → text, and answer text → the model's token ids."""

    def __init__(self, tokenizer: Any) -> None:
        from bench.compare.parity import plain_token_ids

        self._tok = tokenizer
        self._plain = plain_token_ids(tokenizer)

    @classmethod
    def load(cls, model_dir: Path) -> TextCodec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def text(self, sim_ids: Iterable[int]) -> str:
        return self.decode([self._plain[(t - 2) % len(self._plain)] for t in sim_ids])  # sim ids start at 2

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, clean_up_tokenization_spaces=False))

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def encode_all(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tok(texts, add_special_tokens=False)["input_ids"]]


class TextStream:
    """A workload's requests as text; `follow_up` continues a closed loop from an answer."""

    def __init__(self, workload: Workload, codec: TextCodec) -> None:
        self.workload, self.codec = workload, codec

    def initial(self) -> list[StreamRequest]:
        return [StreamRequest(r, self.codec.text(r.tokens)) for r in self.workload.initial()]

    def follow_up(self, parent: StreamRequest, answer: str) -> StreamRequest | None:
        answer = answer.rstrip(_REPLACEMENT)
        output = self.codec.encode(answer)
        child = self.workload.follow_up(parent.sim, output, parent.sim.arrival_s)
        if child is None:
            return None
        if child.step == 0:  # a new session (long_agent starts one when another ends)
            return StreamRequest(child, self.codec.text(child.tokens))
        new = child.tokens[len(parent.sim.tokens) + len(output) :]
        return StreamRequest(child, parent.text + answer + self.codec.text(new))


def replay_offline(stream: TextStream, answer: Callable[[StreamRequest], str]) -> list[StreamRequest]:
    """Every request of `stream` in arrival order, one at a time, with `answer` standing in for
    the model (for sizing: the same requests a run sends, up to the answers' text)."""
    heap = [(r.sim.arrival_s, i, r) for i, r in enumerate(stream.initial())]
    heapq.heapify(heap)
    out, n = [], len(heap)
    while heap:
        _, _, req = heapq.heappop(heap)
        out.append(req)
        nxt = stream.follow_up(req, answer(req))
        if nxt is not None:
            heapq.heappush(heap, (nxt.sim.arrival_s, n, nxt))
            n += 1
    return out


def distinct_tokens(prompts: Iterable[list[int]]) -> int:
    """Prompt tokens no earlier prompt shares as a prefix: the nodes of their token trie."""
    children: dict[tuple[int, int], int] = {}
    for ids in prompts:
        node = 0
        for t in ids:
            node = children.setdefault((node, t), len(children) + 1)
    return len(children)


def estimate_distinct(name: str, scale: float, seed: int, replicas: int, codec: TextCodec) -> int:
    """Distinct prompt tokens of the stream, answers replaced by random text of their length."""

    def answer(req: StreamRequest) -> str:
        rng = random.Random(f"{seed}/answer/{req.rid}")
        return codec.text(rng.randrange(2, 1000) for _ in range(req.sim.max_tokens))

    stream = TextStream(make_workload(name, scale, seed, replicas), codec)
    return distinct_tokens(codec.encode_all([r.text for r in replay_offline(stream, answer)]))


def size_stream(
    name: str, target: int, seed: int, replicas: int, codec: TextCodec, most: float = 512.0
) -> tuple[float, int]:
    """The smallest scale (a power of two, then bisected to whole requests per replica) whose
    stream reaches `target` distinct prompt tokens, and that count; `most` caps it."""
    lo, hi = 0.0, 1.0
    while hi < most and estimate_distinct(name, hi, seed, replicas, codec) < target:
        lo, hi = hi, hi * 2
    hi = min(hi, most)
    while hi - lo > 1:
        mid = float((lo + hi) // 2)
        if estimate_distinct(name, mid, seed, replicas, codec) >= target:
            hi = mid
        else:
            lo = mid
    return hi, estimate_distinct(name, hi, seed, replicas, codec)
