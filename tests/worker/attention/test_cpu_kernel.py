"""The CPU attention kernel: equal to the groups path on random batches, built once per machine
into its private cache (a planted kernel is never loaded), and never required (no compiler, a
failed build, the off switch)."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.attention.conftest import FakePool, kernel_missing
from worker import native
from worker.attention import cpu_kernel
from worker.attention.base import AttentionLayer, AttnBatch, KVView, check_views
from worker.attention.torch_backend import TorchBackend
from worker.models.spec import LayerKind

needs_kernel = pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))




@st.composite
def cases(draw: st.DrawFn) -> dict:
    hkv = draw(st.sampled_from([1, 2, 4]))
    g = draw(st.sampled_from([1, 2, 4]))
    # 48 and 80: value vectors of 16 in passes of 3 and 4 + 1; 8 and 12: rows one by one; 20
    # and 6: head sizes that are no whole number of 8- or 4-float vectors
    d, dv = draw(st.sampled_from([(64, 64), (128, 128), (256, 256), (48, 48), (80, 80), (8, 8),
                                  (16, 12), (20, 20), (6, 16)]))  # fmt: skip
    n = draw(st.integers(1, 6))
    # 3, 9 and 70 prefill rows: no block, one block (8 + 1 register rows), two blocks (64 + 6)
    q_lens = draw(st.lists(st.sampled_from([1, 1, 1, 3, 9, 70]), min_size=n, max_size=n))
    prefixes = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    window = draw(st.sampled_from([None, 1, 5, 31]))
    return {
        "hkv": hkv, "hq": hkv * g, "d": d, "dv": dv, "q_lens": q_lens, "prefixes": prefixes,
        "window": window, "softcap": draw(st.sampled_from([None, 3.0])),
        "sinks": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
    }  # fmt: skip


def _batch(c: dict, slots: int, gen: torch.Generator) -> AttnBatch:
    perm = torch.randperm(slots - 1, generator=gen) + 1
    window, kind = c["window"], LayerKind.FULL if c["window"] is None else LayerKind.SWA
    parts, starts, used = [], [], 0
    for q, p in zip(c["q_lens"], c["prefixes"]):
        start = 0 if window is None else max(0, p - window)
        parts.append(perm[used + start : used + p + q])
        starts.append(start)
        used += p + q
    indptr = torch.cumsum(torch.tensor([0] + [len(x) for x in parts]), 0)
    pos = torch.cat([torch.arange(p, p + q) for p, q in zip(c["prefixes"], c["q_lens"])])
    seq = tuple(p + q for p, q in zip(c["prefixes"], c["q_lens"]))
    view = KVView(torch.cat(parts), indptr, tuple(starts))
    return AttnBatch(tuple(c["q_lens"]), seq, pos, {kind: view}, window)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(cases())
def test_kernel_equals_gather_path(c: dict) -> None:
    """Decodes and prefill chunks with and without a prefix, GQA groups of 1-4, the specialised
    head sizes and generic ones, windows, softcap, sinks: one kernel call per layer; prefill
    rows as blocks of neighbours and one by one."""
    _check_against_gather_path(c)


def _check_against_gather_path(c: dict) -> None:
    gen = torch.Generator().manual_seed(c["seed"])
    slots = 8 + sum(p + q for p, q in zip(c["prefixes"], c["q_lens"]))
    pool = FakePool(torch.randn(slots, c["hkv"], c["d"], generator=gen),
                torch.randn(slots, c["hkv"], c["dv"], generator=gen))  # fmt: skip
    batch = _batch(c, slots, gen)
    check_views(batch)
    kind = next(iter(batch.kv))
    layer = AttentionLayer(0, kind, c["hq"], c["hkv"], c["d"], c["dv"], c["d"] ** -0.5, c["softcap"])
    sinks = torch.randn(c["hq"], generator=gen) if c["sinks"] else None
    q = torch.randn(sum(c["q_lens"]), c["hq"], c["d"], generator=gen)
    fast, ref = TorchBackend(pool, kernel=True), TorchBackend(pool, kernel=False)  # type: ignore[arg-type]
    meta = fast.plan(batch)
    rows = meta.rows[kind]
    assert meta.per_kind[kind] == () and int(rows.count.min()) >= 1  # every row, none skipped
    if c["window"] is not None:  # a sliding-window row reads the window, nothing more
        assert int(rows.count.max()) <= c["window"] + 1
    got = fast.forward(layer, q, meta, sinks)
    want = ref.forward(layer, q, ref.plan(batch), sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=8), st.sampled_from([None, 1, 5, 31]),
       st.integers(0, 2**16))  # fmt: skip
def test_decode_rows_in_python_equal_the_numpy_plan(prefixes: list[int], window: int | None, seed: int) -> None:
    """A batch of single-row decodes is planned in plain Python; the rows equal the numpy
    plan's (the one every other batch takes)."""
    from worker.attention import torch_backend

    c = {"q_lens": [1] * len(prefixes), "prefixes": prefixes, "window": window}
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(c, 8 + sum(prefixes) + len(prefixes), gen)
    (view,) = batch.kv.values()
    fast = torch_backend._kernel_rows(batch, view, window)
    saved = torch_backend._PY_DECODE_ROWS
    try:
        torch_backend._PY_DECODE_ROWS = 0
        ref = torch_backend._kernel_rows(batch, view, window)
    finally:
        torch_backend._PY_DECODE_ROWS = saved
    for got, want in ((fast.slots, ref.slots), (fast.start, ref.start), (fast.count, ref.count)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _x86_layouts() -> list[str]:
    """Flags that build the kernel's other register layouts on this x86 CPU (AVX-512: 16-float
    vectors, 8-row blocks; AVX: 8 floats, 4 rows; SSE: 4 floats, 4 rows): what this CPU runs."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return (["-mno-avx512f"] if "avx512f" in flags else []) + (["-mno-avx"] if "avx" in flags else [])


_LAYOUT_CASES = [  # blocks of 64 + 6 and 8 + 1 rows, rows one by one, decodes; each head size
    {"hkv": 2, "hq": 8, "d": 64, "dv": 64, "q_lens": [70, 9, 1, 3], "prefixes": [0, 30, 50, 4],
     "window": None, "softcap": None, "sinks": False, "seed": 1},
    {"hkv": 2, "hq": 8, "d": 64, "dv": 64, "q_lens": [70, 1, 9], "prefixes": [40, 70, 0],
     "window": 31, "softcap": 3.0, "sinks": True, "seed": 2},
    {"hkv": 1, "hq": 4, "d": 128, "dv": 128, "q_lens": [9, 70], "prefixes": [5, 0],
     "window": None, "softcap": None, "sinks": True, "seed": 3},
    {"hkv": 4, "hq": 4, "d": 256, "dv": 256, "q_lens": [9, 1], "prefixes": [0, 12],
     "window": 5, "softcap": None, "sinks": False, "seed": 4},
    {"hkv": 2, "hq": 4, "d": 48, "dv": 48, "q_lens": [70, 1], "prefixes": [3, 9],
     "window": None, "softcap": 3.0, "sinks": False, "seed": 5},
    {"hkv": 1, "hq": 2, "d": 80, "dv": 80, "q_lens": [9, 9], "prefixes": [0, 33],
     "window": 31, "softcap": None, "sinks": True, "seed": 6},
    {"hkv": 3, "hq": 12, "d": 20, "dv": 20, "q_lens": [1, 1, 9], "prefixes": [7, 60, 2],
     "window": None, "softcap": None, "sinks": False, "seed": 7},
    {"hkv": 1, "hq": 9, "d": 6, "dv": 16, "q_lens": [1, 70], "prefixes": [20, 1],
     "window": 5, "softcap": 3.0, "sinks": True, "seed": 8},
]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("flag", _x86_layouts())
def test_every_register_layout_equals_gather_path(
    flag: str, fresh_load: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel built for a narrower vector unit than this CPU's (its blocks sized to that
    unit's registers) attends exactly as the gather path too."""
    monkeypatch.setattr(native, "COMPILE_FLAGS", (*native.COMPILE_FLAGS, flag))
    assert cpu_kernel.attention_kernel() is not None  # built with the flag, into the fresh cache
    assert len(list(fresh_load.iterdir())) == 1
    for c in _LAYOUT_CASES:
        _check_against_gather_path(c)


@needs_kernel
def test_kernel_reads_a_strided_query() -> None:
    """Queries that are a view of a wider projection (q of a fused qkv) are read in place."""
    gen = torch.Generator().manual_seed(0)
    pool = FakePool(torch.randn(40, 2, 64, generator=gen), torch.randn(40, 2, 64, generator=gen))
    c = {"q_lens": [1, 1, 1], "prefixes": [5, 20, 11], "window": None}
    batch = _batch(c, 40, gen)
    qkv = torch.randn(3, 8 * 64 + 2 * 2 * 64, generator=gen)
    q = qkv[:, : 8 * 64].view(3, 8, 64)  # row stride 768, heads contiguous
    layer = AttentionLayer(0, LayerKind.FULL, 8, 2, 64, 64, 0.125)
    fast, ref = TorchBackend(pool, kernel=True), TorchBackend(pool, kernel=False)  # type: ignore[arg-type]
    got = fast.forward(layer, q, fast.plan(batch))
    torch.testing.assert_close(got, ref.forward(layer, q.contiguous(), ref.plan(batch)))


@pytest.fixture
def fresh_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An empty kernel cache and a forgotten load (restored after the test)."""
    monkeypatch.setenv("SWASERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernel._load.cache_clear()
    yield tmp_path / "cache"
    cpu_kernel._load.cache_clear()


@needs_kernel
def test_built_once_into_the_cache(fresh_load: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = native.compiler()
    assert cc is not None
    first = native.build(cc, cpu_kernel.SOURCE)
    assert first.parent == fresh_load and first.exists()
    runs = []
    real = native.subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real(cmd, **kw))
    assert native.build(cc, cpu_kernel.SOURCE) == first
    assert [cmd[1:] for cmd in runs] == [["--version"]]  # no compile the second time
    assert list(fresh_load.iterdir()) == [first]  # no temporary files left


@needs_kernel
def test_unwritable_cache_builds_into_a_private_temp_dir(fresh_load, tmp_path, monkeypatch, caplog) -> None:
    """A cache that cannot be made: the kernel is built in a fresh private temporary directory,
    loaded, and the directory removed (no shared fixed path under the temp dir)."""
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache "directory" lies under a file: it cannot be made
    monkeypatch.setenv("SWASERVE_KERNEL_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level(logging.INFO, logger="worker"):
        assert TorchBackend(_pool()).kernel is not None  # type: ignore[arg-type]
    assert "private temporary directory" in caplog.text
    assert list((tmp_path / "tmp").iterdir()) == []


@needs_kernel
def test_the_cache_directory_is_created_private(fresh_load: Path) -> None:
    """A new cache directory is 0700 whatever the umask allows."""
    cc = native.compiler()
    assert cc is not None
    native.build(cc, cpu_kernel.SOURCE)
    assert stat.S_IMODE(os.lstat(fresh_load).st_mode) == 0o700


def _plant(directory: Path) -> Path:
    """Garbage under the kernel's exact name: loading it would fail (and run it, were it real)."""
    cc = native.compiler()
    assert cc is not None
    planted = directory / native.kernel_name(cc, cpu_kernel.SOURCE)
    planted.write_bytes(b"not a shared object")
    return planted


def _other_owner(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """`path` appears owned by another user (chown needs root; lstat is what the cache reads)."""
    real = os.lstat

    def lstat(p: object, *args: object, **kw: object) -> os.stat_result:
        st = real(p, *args, **kw)  # type: ignore[arg-type]
        if Path(str(p)) != path:
            return st
        fields = list(st[:10])
        fields[4] = os.geteuid() + 1
        return os.stat_result(fields)

    monkeypatch.setattr(os, "lstat", lstat)


@needs_kernel
@pytest.mark.parametrize("how", ["group/other writable", "a symlink", "another owner"])
def test_a_planted_kernel_in_an_untrusted_cache_is_never_loaded(
    fresh_load: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A cache directory others could write to, a symlink or another user's is refused with a
    log line; its planted kernel is left alone and a privately built one is loaded instead."""
    real_dir = tmp_path / "elsewhere" if how == "a symlink" else fresh_load
    real_dir.mkdir(mode=0o700)
    planted = _plant(real_dir)
    if how == "group/other writable":
        os.chmod(fresh_load, 0o777)
    elif how == "a symlink":
        fresh_load.symlink_to(real_dir)
    else:
        _other_owner(monkeypatch, fresh_load)
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert TorchBackend(_pool()).kernel is not None  # type: ignore[arg-type]
    assert "refusing it" in caplog.text
    assert planted.read_bytes() == b"not a shared object"


@needs_kernel
def test_a_kernel_others_may_write_is_rebuilt(fresh_load: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In a private cache, a kernel file with group/other write (or a symlink) is not trusted:
    it is built again in its place."""
    fresh_load.mkdir(mode=0o700)
    planted = _plant(fresh_load)
    os.chmod(planted, 0o666)
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert TorchBackend(_pool()).kernel is not None  # type: ignore[arg-type]
    assert "others may write" in caplog.text
    assert planted.read_bytes() != b"not a shared object"
    assert not stat.S_IMODE(os.lstat(planted).st_mode) & 0o022


def _pool() -> FakePool:
    return FakePool(torch.zeros(8, 1, 8), torch.zeros(8, 1, 8))


def test_no_compiler_means_the_gather_path(fresh_load, monkeypatch, caplog) -> None:
    monkeypatch.setattr(native, "compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert TorchBackend(_pool()).kernel is None  # type: ignore[arg-type]
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="cannot run"):
        TorchBackend(_pool(), kernel=True)  # type: ignore[arg-type]


@needs_kernel
def test_failed_build_means_the_gather_path(fresh_load, tmp_path, monkeypatch, caplog) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int swaserve_attention_f32(void) { return not C; }\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert TorchBackend(_pool()).kernel is None  # type: ignore[arg-type]
    assert "CPU attention kernel off" in caplog.text and "failed" in caplog.text
    assert not list(fresh_load.glob("*.so"))


@needs_kernel
def test_off_switch_and_other_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TorchBackend(_pool()).kernel is not None  # type: ignore[arg-type]
    monkeypatch.setenv("SWASERVE_CPU_KERNEL", "0")
    assert TorchBackend(_pool()).kernel is None  # type: ignore[arg-type]
    monkeypatch.delenv("SWASERVE_CPU_KERNEL")
    bf16 = FakePool(torch.zeros(8, 1, 8, dtype=torch.bfloat16), torch.zeros(8, 1, 8, dtype=torch.bfloat16))
    assert TorchBackend(bf16).kernel is None  # type: ignore[arg-type]
    assert TorchBackend(_pool(), kernel=False).kernel is None  # type: ignore[arg-type]
