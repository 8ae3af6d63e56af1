"""The messages of the delta channel between an ingress replica and a worker replica.

A channel is one long-lived streaming call per (ingress replica, worker replica),
`WorkerDeployment.deltas(Subscribe)`, pinned to the worker replica by the router
(`router.pinned`). A request's own call (`WorkerDeployment.generate(request, key)`) still
carries its placement, refusals, errors and cancellation; when its ingress has a channel open on
the replica, its `StreamStart` (naming the channel, `StreamStart.channel`) and its deltas travel
on the channel instead, keyed by the attempt's `StreamKey.nonce`: its stream then yields nothing
and ends on its own once every choice's final delta is on the channel, and a stream that fails
says first how many deltas it put there and on which channel (`ChannelEnd`), so the ingress can
order the two (docs/design.md §4.2). The batches themselves travel on a TCP connection to the
ingress when the worker can open one (`deploy/replica/delta_socket.py`), else on the call. All
plain module-level dataclasses: Serve pickles the items with the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.messages import StreamStart
from core.outputs import StreamDelta
from router.pinned import PinnedCall


@dataclass(frozen=True)
class StreamKey:
    """Which ingress sent an attempt of a request, and the attempt's nonce (new per attempt:
    a lost attempt's late deltas never reach the next)."""

    ingress_id: str
    nonce: str


@dataclass(frozen=True)
class Subscribe(PinnedCall):
    """Open ingress `ingress_id`'s channel on replica `replica_id`; `subscription` names this
    opening (an ingress opens a new one after a channel failed)."""

    ingress_id: str = ""
    subscription: str = ""
    endpoint: tuple[str, int] | None = None  # the ingress's delta socket (`delta_socket.py`)
    token: str = ""  # the first frame the worker sends on it: names this channel


@dataclass(frozen=True)
class OnSocket:
    """The channel's first item when its batches travel on the ingress's delta socket: the
    call sends nothing more and ends after the connection's last frame went out."""


@dataclass(frozen=True)
class ChannelEnd:
    """The last request-stream item of an attempt on a channel whose stream raises, before the
    error: the attempt put `deltas` deltas on channel `channel` (a subscription) before it. (A
    stream that ends without an error sends none: every choice's final delta is on the channel
    by then.)"""

    deltas: int
    channel: str = ""


@dataclass(frozen=True)
class Moved:
    """A request-stream item of an attempt that began inline (its ingress had no channel on the
    replica yet) once that ingress has one: every later delta goes on channel `channel` under
    the attempt's nonce, and the stream ends, or fails after a `ChannelEnd`, as a channel
    attempt's does. Serve's stream of a long inline request could fall seconds behind under
    load while the channel's kept up."""

    channel: str


@dataclass(frozen=True)
class DeltaBatch:
    """One channel item: everything put on the channel since the last item, as (nonce, item)
    in the order it was put; an attempt's `StreamStart` comes before its deltas."""

    items: list[tuple[str, StreamDelta | StreamStart]]
