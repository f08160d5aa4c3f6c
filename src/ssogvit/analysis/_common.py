"""Helpers shared by the analyses: which mixers a model has, its grid, capturing mixer inputs, writing results."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn


def is_ssog(mixer: nn.Module) -> bool:
    """True for an SSoG mixer (it owns a Gaussian field `mu`, `rho`, `ell`)."""
    return all(hasattr(mixer, a) for a in ("mu", "rho", "ell", "mixture"))


def is_steered(mixer: nn.Module) -> bool:
    """True for an SSoG mixer with at least one steering path switched on."""
    return is_ssog(mixer) and bool(tuple(getattr(mixer, "steer", ()) or ()))


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) or not isinstance(v, Sequence) else (int(v[0]), int(v[1]))


def mixer_grid(model: nn.Module, img_size=None) -> tuple[int, int]:
    """`(Gh, Gw)` of `model` at its own (or the given) image size."""
    h, w = _pair(img_size if img_size is not None else model.img_size)
    ph, pw = _pair(model.patch_size)
    return h // ph, w // pw


def mixer_rows(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(label, mixer)` for each distinct mixer, in order: one per block, one shared for looped and ODE models."""
    mixers = list(model.mixers())
    family = getattr(model, "family", "vit")
    if family != "vit" and len(mixers) == 1:
        return [(f"shared block ({family})", mixers[0])]
    return [(f"block {i}", m) for i, m in enumerate(mixers)]


@contextmanager
def capture_mixer_inputs(model: nn.Module) -> Iterator[list[list[tuple[torch.Tensor, tuple[int, int]]]]]:
    """Record `(x, grid)` of every call of every mixer while the context is open: `records[i]` for mixer `i`."""
    mixers = list(model.mixers())
    records: list[list] = [[] for _ in mixers]
    handles = []
    for i, m in enumerate(mixers):
        def hook(mod, args, kwargs, i=i):
            grid = kwargs.get("grid", args[1] if len(args) > 1 else None)
            records[i].append((args[0].detach(), tuple(grid)))
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def write_json(path: Path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON serialisable: {type(v)}")


def fmt(v, digits: int = 3) -> str:
    """A table cell: floats to `digits` significant decimals, `None`/NaN as an em dash."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v == 0 or 0.01 <= abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a literal bar (|x|, ||J||) must not split the cell

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(fmt(c)) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
