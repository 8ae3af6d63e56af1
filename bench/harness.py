"""Small shared pieces for `swaserve bench <subcommand>`: output folder, JSON, markdown tables,
progress bars, plot saving, and a loopback port and quiet Ray logs for the benchmarks that start
Serve. Each subcommand module exposes

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int          # exit status

and writes `<output_dir>/<name>.json`, `summary.md` and PNG plots through these helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

T = TypeVar("T")


def add_output_arguments(parser: argparse.ArgumentParser, default_dir: str) -> None:
    """--output-dir (default `default_dir`) and --no-plots, the same for every subcommand."""
    parser.add_argument(
        "--output-dir", type=Path, default=Path(default_dir),
        help=f"folder for the JSON, markdown and PNG results (default: {default_dir})",
    )  # fmt: skip
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def prepare_output_dir(path: str | Path) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def to_jsonable(value: Any) -> Any:
    """Dataclasses, tuples, Paths and dict keys made plain JSON (dict keys become strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(to_jsonable(data), indent=2) + "\n")
    return path


def write_text(path: Path, text: str) -> Path:
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are str()-ed, numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    align = [
        "---:" if cells and _numeric(r[i] for r in cells) else "---" for i in range(len(headers))
    ]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _numeric(cells: Iterable[str]) -> bool:
    return all(
        c.replace(",", "").replace(".", "", 1).replace("x", "").strip().isdigit() for c in cells
    )


def progress(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterator[T]:
    """tqdm over `items`, silent when stderr is not a terminal (CI, tests, pipes)."""
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, leave=False, disable=not sys.stderr.isatty())


def new_figure(
    ncols: int = 1, *, width: float = 6.0, height: float = 4.0
) -> tuple[Figure, list[Axes]]:
    """A figure with `ncols` side-by-side axes on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot; the bench never opens a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig: Figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
