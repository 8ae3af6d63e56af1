"""The layering is enforced by tools, not by review: import-linter's contracts in pyproject.toml,
no blocking call inside a coroutine, and Ray internals in one module (AST checks below)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "worker", "cluster", "router", "deploy", "bench", "swaserve")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_import_contracts_hold() -> None:
    """Every import-linter contract of pyproject.toml is kept by the tree as it is."""
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("worker/config.py", "import deploy.config", "layers"),
        ("deploy/cli.py", "import bench.cli", "layers"),
        ("bench/routing/report.py", "import bench.routing.main", "bench: no import circle"),
        ("worker/engine/stats.py", "import ray", "worker imports neither Ray nor HTTP code"),
        ("cluster/messages.py", "import torch", "import no torch"),
        ("core/geometry.py", "import torch", "import no torch"),
        ("router/core.py", "import worker.config", "import no torch"),
        ("worker/assembly/builder.py", "import worker.engine.engine", "never upward"),
    ],
)
def test_import_contracts_catch_a_violation(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    """A copy of the tree with one forbidden import breaks the contract that names it."""
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # the violation\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [ln for ln in result.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(contract in ln for ln in broken), result.stdout


def test_router_and_cluster_load_without_torch() -> None:
    """The router's decision path and the cross-process types import no torch at runtime."""
    code = (
        "import sys, core.events, core.reuse, cluster.messages, cluster.index, router.core, router.policies; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


# ---- no blocking call inside `async def` ---------------------------------------------------

# Calls that block the event loop they run on, and what to do instead inside `async def`.
BLOCKING_CALLS = {
    "ray.get": "await the ObjectRef",
    "ray.wait": "asyncio.wait over the awaited ObjectRefs",
    "ray.get_actor": "await asyncio.to_thread(ray.get_actor, ...)",
    "ray.kill": "await asyncio.to_thread(ray.kill, ...)",
    "ray.serve.status": "await asyncio.to_thread(serve.status)",
    "ray.serve.run": "await asyncio.to_thread(serve.run, ...)",
    "ray.serve.delete": "await asyncio.to_thread(serve.delete, ...)",
    "ray.serve.shutdown": "await serve.shutdown_async()",
    "cluster.transport.get_or_create_index_actor": "await asyncio.to_thread(...)",
    "cluster.transport.find_index_actor": "await asyncio.to_thread(...)",
    "cluster.transport.kill_index_actor": "await asyncio.to_thread(...)",
    "time.sleep": "await asyncio.sleep(...)",
    "subprocess.run": "asyncio.create_subprocess_exec",
    "urllib.request.urlopen": "an async HTTP client (httpx.AsyncClient)",
}


def _module_names(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> dotted origin: imports anywhere in the module, and its top-level defs."""
    names = {
        n.name: f"{module}.{n.name}"
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return names


def _origin(expr: ast.expr, names: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    return ".".join([names[expr.id], *reversed(parts)])


def _own_calls(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.Call]:
    """Calls the function itself makes: nested defs and lambdas run elsewhere (a thread, later)."""
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue  # a nested `async def` is checked on its own
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _blocking_helpers(tree: ast.Module, names: dict[str, str]) -> dict[str, str]:
    """The module's own sync functions and methods that make a blocking call: name -> call."""
    defs = [*tree.body, *(m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body)]
    helpers = {}
    for fn in (d for d in defs if isinstance(d, ast.FunctionDef)):
        origin = next(
            (o for c in _own_calls(fn) if (o := _origin(c.func, names)) in BLOCKING_CALLS), None
        )
        if origin is not None:
            helpers[fn.name] = origin
    return helpers


def _callee(call: ast.Call) -> str | None:
    """`f(...)` -> f, `self.f(...)` / `cls.f(...)` -> f: the module's own functions and methods."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in ("self", "cls")
    ):
        return func.attr
    return None


def blocking_calls_in_async(root: Path) -> list[str]:
    """`path:line: async def f calls X (instead: Y)` for every blocking call a coroutine makes,
    directly or through one of its module's sync helpers (one level)."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            tree = ast.parse(path.read_text(), str(rel))
            names = _module_names(tree, ".".join(rel.with_suffix("").parts))
            helpers = _blocking_helpers(tree, names)
            for fn in (n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)):
                for call in _own_calls(fn):
                    origin, via = _origin(call.func, names), ""
                    if origin not in BLOCKING_CALLS and _callee(call) in helpers:
                        via, origin = f"{_callee(call)}(), which calls ", helpers[_callee(call)]  # type: ignore[index]
                    if origin in BLOCKING_CALLS:
                        found.append(f"{rel}:{call.lineno}: async def {fn.name} calls {via}{origin} "
                                     f"(instead: {BLOCKING_CALLS[origin]})")  # fmt: skip
    return found


def test_no_blocking_call_inside_async_def() -> None:
    """No coroutine in worker/cluster/router/deploy/bench calls a known-blocking function."""
    assert blocking_calls_in_async(REPO) == []


PLANTED = {
    "ray.get": (
        "deploy/replica/client.py",
        "import ray\n\n\nasync def _planted(ref):\n    return ray.get(ref)\n",
    ),
    "cluster.transport.find_index_actor": (
        "router/serve_router.py",
        "async def _planted():\n    if True:\n        transport.find_index_actor('x')\n",
    ),
    "time.sleep": (
        "bench/routing/real_traffic.py",
        "from time import sleep as nap\n\n\nasync def _planted():\n    nap(1)\n",
    ),
    "ray.kill": (
        "cluster/transport.py",
        "class _Planted:\n    def _stop(self, a):\n        ray.kill(a)\n\n"
        "    async def _planted(self, a):\n        self._stop(a)\n",
    ),
}


@pytest.mark.parametrize("origin", sorted(PLANTED))
def test_blocking_call_check_catches_a_planted_violation(tmp_path: Path, origin: str) -> None:
    """A copy of the tree with one blocking call inside an `async def` is reported, by name."""
    module, code = PLANTED[origin]
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text() + "\n\n" + code)
    found = blocking_calls_in_async(tmp_path)
    assert len(found) == 1 and "async def _planted calls " in found[0], found
    assert found[0].split(" (instead")[0].endswith(origin), found


def test_blocking_call_check_allows_threads_and_nested_sync_defs(tmp_path: Path) -> None:
    """Handing the function to a thread, or calling it in a nested sync def, is fine."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "cluster" / "ok.py").write_text(
        "import asyncio\nimport ray\n\n\nasync def fine(ref):\n"
        "    actor = await asyncio.to_thread(ray.get_actor, 'x')\n\n"
        "    def in_thread():\n        return ray.get(ref)\n\n"
        "    return actor, await asyncio.to_thread(in_thread), await ref\n"
    )  # fmt: skip
    assert blocking_calls_in_async(tmp_path) == []


# ---- Ray internals live in one module -------------------------------------------------------

RAY_PRIVATE_HOME = {
    Path("cluster/ray_private.py"),
    Path("tests/serve_internals.py"),
    Path("tests/cluster/test_ray_private.py"),
}


def ray_internals_outside_home(root: Path) -> list[str]:
    """Uses of a Ray internal outside `cluster/ray_private.py`: a `_private` module, an
    underscore attribute of something imported from Ray, an underscore keyword to a Ray call."""
    found = []
    for path in sorted(p for d in (*PACKAGES, "tests") for p in (root / d).rglob("*.py")):
        rel = path.relative_to(root)
        if rel in RAY_PRIVATE_HOME:
            continue
        tree = ast.parse(path.read_text(), str(rel))
        names = _module_names(tree, ".".join(rel.with_suffix("").parts))
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                hit = next((m for m in mods if m.startswith("ray") and "._" in m), None)
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                origin = _origin(node, names)
                hit = origin if origin and origin.startswith("ray.") else None
            elif isinstance(node, ast.Call) and (_origin(node.func, names) or "").startswith(
                "ray."
            ):
                hit = next((f"{_origin(node.func, names)}({k.arg}=)" for k in node.keywords
                            if k.arg and k.arg.startswith("_")), None)  # fmt: skip
            if hit:
                found.append(f"{rel}:{node.lineno}: {hit}")
    return found


def test_ray_internals_only_in_ray_private() -> None:
    """Every Ray internal the code uses goes through `cluster.ray_private`, and every one only
    the tests use through `tests.serve_internals`."""
    assert ray_internals_outside_home(REPO) == []


@pytest.mark.parametrize(
    ("module", "line", "hit"),
    [
        (
            "deploy/serve_local.py",
            "from ray.serve._private.constants import SERVE_NAMESPACE",
            "ray.serve._private.constants",
        ),
        ("router/serve_router.py", "ray._private.worker.global_worker", "ray._private"),
        ("deploy/app.py", "serve._run(None, _blocking=False)", "ray.serve._run(_blocking=)"),
    ],
)
def test_ray_internals_check_catches_a_planted_use(
    tmp_path: Path, module: str, line: str, hit: str
) -> None:
    """A copy of the tree with one Ray internal outside cluster/ray_private.py is reported."""
    for pkg in (*PACKAGES, "tests"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # the violation\n")
    found = ray_internals_outside_home(tmp_path)
    assert found and all(f.startswith(f"{module}:") for f in found), found
    assert any(f.endswith(hit) for f in found), found


# ---- one writer per request field -----------------------------------------------------------

# `Req` and `ReqKV` change only under the scheduler's verbs: `scheduler.py` writes `Req` and
# allocates and commits `ReqKV`; `kv_state.py` records what the cache hooks return, the window
# frees and the page-table row. Everyone else (engine, cache, runner, bench) only reads them.
STATE_CLASSES = {
    Path("worker/scheduler/request.py"): "Req",
    Path("worker/cache/req_kv.py"): "ReqKV",
}
STATE_WRITERS = {Path("worker/scheduler/scheduler.py"), Path("worker/scheduler/kv_state.py")}
# A module that holds a Req or a ReqKV imports from where they live or are handed out; checking
# only those keeps same-named attributes of other objects (a tree node's `key`, a choice's
# `tokens`, a bench track's `output`) out of the report.
STATE_PACKAGES = ("worker.scheduler", "worker.cache")
LIST_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def state_fields(root: Path) -> set[str]:
    """The field names of `Req` and `ReqKV`, read from their class bodies."""
    fields: set[str] = set()
    for rel, name in STATE_CLASSES.items():
        tree = ast.parse((root / rel).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        fields |= {
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
    return fields


def _imports_from(tree: ast.Module, packages: tuple[str, ...]) -> bool:
    for node in ast.walk(tree):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods = [node.module]
        if any(m == p or m.startswith(p + ".") for m in mods for p in packages):
            return True
    return False


def _attribute_writes(node: ast.AST) -> Iterator[tuple[ast.expr, str]]:
    """(object, attribute) for each attribute `node` writes: a target of =, augmented or
    annotated assignment (tuples and starred targets unpacked, an item stored into the
    attribute), `setattr` with a literal name, an in-place list method called on it."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Call):
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id == "setattr" and len(args) > 1:
            if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                yield args[0], args[1].value
        elif isinstance(func, ast.Attribute) and func.attr in LIST_MUTATORS:
            if isinstance(func.value, ast.Attribute):
                yield func.value.value, func.value.attr
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, (ast.Starred, ast.Subscript)):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            yield target.value, target.attr


def request_state_writes(root: Path) -> list[str]:
    """`path:line: obj.field` for every write of a `Req` / `ReqKV` field outside the scheduler's
    writers. A write through `self` is the writing class's own attribute (inside `Req` or `ReqKV`
    themselves, their own methods) and does not count."""
    fields = state_fields(root)
    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            tree = ast.parse(path.read_text(), str(rel))
            if rel in STATE_WRITERS or not _imports_from(tree, STATE_PACKAGES):
                continue
            for node in ast.walk(tree):
                for obj, attr in _attribute_writes(node):
                    if attr in fields and not (isinstance(obj, ast.Name) and obj.id == "self"):
                        found.append(f"{rel}:{node.lineno}: {ast.unparse(obj)}.{attr}")
    return found


def test_only_the_scheduler_writes_request_state() -> None:
    """No module but the scheduler's writers assigns a field of `Req` or `ReqKV`."""
    assert request_state_writes(REPO) == []


PLANTED_WRITES = {
    "augmented": ("worker/engine/engine.py", "req.pending += 1", ["req.pending"]),
    "annotated": (
        "worker/scheduler/budget.py",
        "req.cached_tokens: int = 0",
        ["req.cached_tokens"],
    ),
    "tuple and starred": (
        "worker/cache/radix_cache.py",
        "kv.row, (first, *kv.tokens) = -1, (0, 1)",
        ["kv.row", "kv.tokens"],
    ),
    "item store": ("worker/cache/chunk_cache.py", "kv.table[0] = 1", ["kv.table"]),
    "setattr": ("worker/engine/step_io.py", "setattr(req, 'follows', None)", ["req.follows"]),
    "in-place method": ("worker/engine/overlap.py", "w.req.output.append(1)", ["w.req.output"]),
}


def _tree_copy_with(tmp_path: Path, planted: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for module, body in planted.items():
        target = tmp_path / module
        target.write_text(target.read_text() + f"\n\ndef _planted(req, kv, w):\n    {body}\n")
    return tmp_path


@pytest.mark.parametrize("kind", sorted(PLANTED_WRITES))
def test_request_state_check_catches_a_planted_write(tmp_path: Path, kind: str) -> None:
    """A copy of the tree with one write of a request field outside the scheduler is reported."""
    module, body, hits = PLANTED_WRITES[kind]
    found = request_state_writes(_tree_copy_with(tmp_path, {module: body}))
    assert sorted(f.split(": ", 1)[1] for f in found) == hits, found
    assert all(f.startswith(f"{module}:") for f in found), found


def test_request_state_check_ignores_owners_and_other_objects(tmp_path: Path) -> None:
    """Writes by the scheduler, through `self`, of other attributes, or in a module that
    cannot hold a request are not reported."""
    root = _tree_copy_with(tmp_path, {
        "worker/scheduler/scheduler.py": "req.pending += 1",
        "worker/engine/engine.py": "w.cursor.emitted, w.node.parent = 1, None",
        "worker/kv/allocator.py": "w.key = req.output = []",
    })  # fmt: skip
    (root / "worker/engine/engine.py").write_text(
        (root / "worker/engine/engine.py").read_text()
        + "\n\nclass _Planted:\n    def __init__(self):\n        self.pending = 0\n"
    )
    assert request_state_writes(root) == []
