"""Writing results: Markdown tables and figures, for the analyses and the conversion report (JSON files through
`ssogvit.outputs.write_json` with `default=jsonable`).

Each file goes through the one writer (`ssogvit.outputs.atomic_write`: a kill leaves the old file or nothing). These
helpers replace a file that exists: the command calling them has checked its outputs first (`--overwrite`,
`ssogvit.outputs.check_output_file`, `staged_outputs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ssogvit.outputs import atomic_write, write_text

__all__ = ["fmt", "figure_problems", "jsonable", "markdown_table", "pyplot", "save_figure", "write_markdown"]


def jsonable(v: Any) -> Any:
    """A result's value JSON does not know, as JSON (tensors as lists, paths as strings): the `default` of
    `ssogvit.outputs.write_json` for results; anything else is refused with `TypeError`."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON serialisable: {type(v)}")


def write_markdown(path: str | Path, text: str) -> Path:
    """``text`` to ``path``; creates the folder."""
    return write_text(path, text, overwrite=True)


def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant decimals, ``None``/NaN as an em dash."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v == 0 or 0.01 <= abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table, cells formatted by ``fmt``."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a literal bar (|x|, ||J||) must not split the cell

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(fmt(c)) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend (imported on first use: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_problems(fig: Any) -> list[str]:
    """What a reader would not accept in ``fig``, one line each (empty: none): a visible axes with nothing drawn in it
    (no line, patch, image or collection: a panel explained away in a footnote instead of left out), and a title (an
    axes' or the figure's) that reaches outside the figure, as drawn with its layout (cut off in the saved file)."""
    fig.canvas.draw()  # applies tight / constrained layout, as savefig does
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    problems = []
    for i, ax in enumerate(fig.axes):
        if ax.get_visible() and not ax.has_data() and ax.get_label() != "<colorbar>":
            problems.append(f"axes {i} ({ax.get_title() or 'untitled'!r}) is empty")
    titles = [t for ax in fig.axes if ax.get_visible() for t in (ax.title, ax._left_title, ax._right_title)]
    titles += [fig._suptitle] if fig._suptitle is not None else []
    for text in titles:
        if not text.get_text() or not text.get_visible():
            continue
        ext = text.get_window_extent(renderer)
        if ext.x0 < box.x0 - 1 or ext.x1 > box.x1 + 1 or ext.y0 < box.y0 - 1 or ext.y1 > box.y1 + 1:
            problems.append(f"title {text.get_text()[:60]!r} is clipped: it spans x {ext.x0:.0f}..{ext.x1:.0f}, "
                            f"y {ext.y0:.0f}..{ext.y1:.0f} of a {box.width:.0f}x{box.height:.0f} figure")
    return problems


def save_figure(fig: Any, path: str | Path) -> Path:
    """Save ``fig`` as ``path`` (110 dpi, the format of its suffix), creating the folder, and close it."""
    path = Path(path)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or None),
                     overwrite=True)
    finally:
        pyplot().close(fig)
    return path
