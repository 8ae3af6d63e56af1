"""The processes of a server the harness started, by role, and their CPU time (Linux `/proc`).

A server's processes are the descendants of the PID the harness started (so another engineer's
server on the same machine is never counted). Roles come from the process titles Ray and vLLM
set: swaserve's ``ray::ServeReplica:swaserve:Worker`` / ``…:Ingress``, ``ray::ProxyActor``
(Serve's HTTP proxy) and each worker's engine process (its ``-c`` entry runs ``worker.hosts.engine_process``),
vLLM's API server (the started process itself), ``VLLM::EngineCore`` and
``VLLM::Worker``. CPU time is utime + stime of ``/proc/<pid>/stat``, all threads included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
ROLE_TITLES = (
    ("worker", "ServeReplica:swaserve:Worker"),
    ("engine", "'worker.hosts.engine_process'"),  # a worker replica's engine (its child's entry)
    ("ingress", "ServeReplica:swaserve:Ingress"),
    ("proxy", "ray::ProxyActor"),
    ("engine_core", "VLLM::EngineCor"),
    ("worker", "VLLM::Worker"),
)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    title: str  # the cmdline as `ps` shows it (Ray and vLLM rewrite it), else the comm name
    cpu_s: float
    nice: int


def read_proc(pid: int, proc_root: Path = PROC) -> ProcInfo | None:
    """One process's parent, title, CPU seconds and niceness; None if it is gone."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
        cmdline = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    # fields after the comm, 0-based: 1 ppid, 11 utime, 12 stime (clock ticks), 16 nice
    ticks = os.sysconf("SC_CLK_TCK")
    title = cmdline.replace(b"\0", b" ").decode(errors="replace").strip() or comm
    return ProcInfo(pid, int(rest[1]), title, (int(rest[11]) + int(rest[12])) / ticks, int(rest[16]))


def descendants(root: int, proc_root: Path = PROC) -> list[ProcInfo]:
    """`root` and every process below it (one pass over /proc)."""
    pids = [int(p.name) for p in proc_root.iterdir() if p.name.isdigit()]
    infos = [i for i in (read_proc(p, proc_root) for p in pids) if i is not None]
    children: dict[int, list[ProcInfo]] = {}
    for info in infos:
        children.setdefault(info.ppid, []).append(info)
    out = [i for i in infos if i.pid == root]
    frontier = [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        out += kids
        frontier += [k.pid for k in kids]
    return out


def role_of(info: ProcInfo, root: int) -> str | None:
    for role, title in ROLE_TITLES:
        if title in info.title:
            return role
    return "api_server" if info.pid == root and "vllm" in info.title else None


def role_pids(root: int, proc_root: Path = PROC) -> dict[str, list[int]]:
    """Role → PIDs among `root`'s descendants (roles without a process are left out)."""
    out: dict[str, list[int]] = {}
    for info in descendants(root, proc_root):
        role = role_of(info, root)
        if role:
            out.setdefault(role, []).append(info.pid)
    return out


def thread_cpu_seconds(pid: int, proc_root: Path = PROC) -> dict[int, float]:
    """Thread id → CPU seconds so far, for every thread of `pid`; empty if it is gone."""
    task_root = proc_root / str(pid) / "task"
    try:
        tids = [int(t.name) for t in task_root.iterdir() if t.name.isdigit()]
    except OSError:
        return {}
    return {i.pid: i.cpu_s for i in (read_proc(t, task_root) for t in tids) if i is not None}


def thread_comms(pid: int, proc_root: Path = PROC) -> dict[int, str]:
    """Thread id → the kernel's name of the thread (Python's thread names are not it: Ray's
    threads mostly carry the process title they started under, e.g. ``ray::IDLE``)."""
    out = {}
    for tid in thread_cpu_seconds(pid, proc_root):
        try:
            stat = (proc_root / str(pid) / "task" / str(tid) / "stat").read_text()
        except OSError:
            continue
        out[tid] = stat[stat.index("(") + 1 : stat.rindex(")")]
    return out


def cpu_seconds(pids: dict[str, list[int]], proc_root: Path = PROC) -> dict[str, float]:
    """Role → CPU seconds so far, summed over its processes (a vanished one counts 0)."""
    out = {}
    for role, group in pids.items():
        infos = [read_proc(p, proc_root) for p in group]
        out[role] = sum(i.cpu_s for i in infos if i)
    return out
