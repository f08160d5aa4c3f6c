"""Draw what a model's token mixers learned: the Gaussian atoms of every SSoG head, and the dense attention field of
one query position on a real image (SSoG and MHA alike)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from ssogvit import results
from ssogvit.layers import is_ssog
from ssogvit.models.maps import record_attention

from ._common import UNTRAINED_NOTE, mixer_rows, untrained_field_mixers
from .atoms import effective_atoms


@torch.no_grad()
def atom_geometry(mixer: nn.Module) -> dict[str, Tensor]:
    """Centres `mu (H, R, 2)`, kernel standard deviations `sigma * sqrt(tau)` `(H, R, 2)` and weights `(H, R)`.

    The axis kernel `exp(-(d - mu)^2 / (2 sigma^2 tau))` is a Gaussian of standard deviation `sigma * sqrt(tau)` in
    the offset `d` (source minus query, grid cells, axis order `(y, x)`).
    """
    tau = mixer.tau().detach().double()
    tau = tau.reshape(-1, 1, 1) if tau.ndim else tau
    return {
        "mu": mixer.mu.detach().double().cpu(),
        "std": (mixer.sigma().detach().double() * tau.sqrt()).cpu(),
        "weight": mixer.mixture().detach().double().cpu(),
    }


def plot_fields(model: nn.Module, path: str | Path, *, title: str | None = None) -> Path | None:
    """Atoms of every SSoG mixer: one row per mixer (one for looped / ODE models), one panel per head.

    Each atom is an ellipse at its centre offset from the query cell (marked at the origin), with semi-axes of one
    standard deviation (filled, opacity by mixture weight) and two (dashed outline). Returns `None` when the model
    has no SSoG mixer.
    """
    from matplotlib.patches import Ellipse, Rectangle

    plt = results.pyplot()
    untrained = untrained_field_mixers(model)
    rows = [(f"{name}\n{UNTRAINED_NOTE}" if i in untrained else name, m)
            for i, (name, m) in enumerate(mixer_rows(model)) if is_ssog(m)]
    if not rows:
        return None
    geoms = [atom_geometry(m) for _, m in rows]
    heads, atoms = geoms[0]["weight"].shape
    reach = max(float((g["mu"].abs() + 2 * g["std"]).amax()) for g in geoms)
    lim = min(max(2.5, math.ceil(reach) + 0.5), 64.5)
    colors = plt.get_cmap("tab10").colors
    size = 1.9
    fig, axes = plt.subplots(len(rows), heads, figsize=(size * heads + 0.4, size * len(rows) + 0.7), squeeze=False,
                             layout="constrained")
    for li, ((name, _), g) in enumerate(zip(rows, geoms)):
        eff = effective_atoms(g["weight"])
        for h in range(heads):
            ax = axes[li][h]
            ax.add_patch(Rectangle((-0.5, -0.5), 1, 1, facecolor="0.85", edgecolor="0.4", lw=0.8, zorder=0))
            for r in range(atoms):
                (my, mx), (sy, sx), w = g["mu"][h, r].tolist(), g["std"][h, r].tolist(), float(g["weight"][h, r])
                c = colors[r % len(colors)]
                ax.add_patch(Ellipse((mx, my), 2 * sx, 2 * sy, facecolor=c, alpha=0.15 + 0.8 * w, edgecolor=c, lw=1.0))
                ax.add_patch(Ellipse((mx, my), 4 * sx, 4 * sy, fill=False, edgecolor=c, lw=0.8, ls="--", alpha=0.7))
                ax.plot(mx, my, "+", color=c, ms=5, mew=1.2)
            ax.set_xlim(-lim, lim)
            ax.set_ylim(lim, -lim)  # raster order: y grows downwards
            ax.set_aspect("equal")
            ticks = range(-int(lim), int(lim) + 1, max(1, int(lim) // 3))
            ax.set_xticks(list(ticks))
            ax.set_yticks(list(ticks))
            ax.tick_params(labelsize=6)
            ax.grid(True, lw=0.3, alpha=0.5)
            ax.set_title(f"h{h}  eff. atoms {float(eff[h]):.2f}", fontsize=7)
            if h == 0:
                ax.set_ylabel(f"{name}\nΔy (cells)", fontsize=7)
            if li == len(rows) - 1:
                ax.set_xlabel("Δx (cells)", fontsize=7)
    default = "SSoG atoms: centre, 1σ (fill, opacity = weight λ) and 2σ (dashed), offsets from the query"
    fig.suptitle(title or default, fontsize=9)
    return results.save_figure(fig, path)


@torch.no_grad()
def query_field_maps(
    model: nn.Module, image: Tensor, query: tuple[int, int] | None = None
) -> tuple[list[Tensor], tuple[int, int]]:
    """Head-averaged attention of one patch query over the patch grid, one map per mixer application.

    Args:
        image: `(C, H, W)`, preprocessed as the model expects.
        query: `(qy, qx)` in grid cells; the grid centre by default.

    Returns:
        `([(Gh, Gw), ...], (qy, qx))`.
    """
    model.eval()
    p = model.patch_size
    grid = (image.shape[-2] // p, image.shape[-1] // p)
    qy, qx = query if query is not None else (grid[0] // 2, grid[1] // 2)
    if not (0 <= qy < grid[0] and 0 <= qx < grid[1]):
        raise ValueError(f"query {(qy, qx)} is outside the grid {grid}")
    with record_attention(model) as maps:
        model.forward_features(image[None])
    prefix = int(model.num_prefix_tokens)
    q = prefix + qy * grid[1] + qx
    return [m[0, :, q, prefix:].mean(0).reshape(grid).float().cpu() for m in maps], (qy, qx)


def _pick(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _display(image: Tensor) -> Tensor:
    img = image.detach().float().cpu()
    img = (img - img.amin()) / (img.amax() - img.amin()).clamp_min(1e-8)
    return img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)


def plot_query_fields(
    models: Mapping[str, nn.Module], image: Tensor, path: str | Path, *, query: tuple[int, int] | None = None,
    max_columns: int = 6,
) -> tuple[Path, dict]:
    """Dense attention field of one query on `image`, overlaid on it: one row per model, one column per (selected)
    mixer application, every panel on one colour scale (0 to the largest weight drawn), shown by a colour bar.
    Returns the path and, per model, the share of attention inside the 3x3 cells around the query and the peak
    weight, per application drawn."""
    from matplotlib.patches import Rectangle

    plt = results.pyplot()
    fields = {label: query_field_maps(m, image, query) for label, m in models.items()}
    # a discrete model applies its mixers in order, so the untrained last mixer is the last application
    untrained = {label: {len(fields[label][0]) - 1} if untrained_field_mixers(m) else set()
                 for label, m in models.items()}
    cols = max(len(_pick(len(f[0]), max_columns)) for f in fields.values())
    vmax = max(float(maps[i].max()) for maps, _ in fields.values() for i in _pick(len(maps), max_columns))
    drawn = None
    fig, axes = plt.subplots(len(models), cols, figsize=(max(2.6 * cols, 5.5) + 1.2, 2.8 * len(models) + 0.6),
                             squeeze=False, layout="constrained")
    dimmed = 0.1 + 0.6 * _display(image)  # grey or colour, in [0.1, 0.7]
    hgt, wid = image.shape[-2:]
    summary = {}
    for row, (label, (maps, (qy, qx))) in enumerate(fields.items()):
        p = models[label].patch_size
        picks = _pick(len(maps), max_columns)
        summary[label] = {"query": [qy, qx], "applications": picks, "local_3x3": [], "peak": []}
        for c in range(cols):
            ax = axes[row][c]
            ax.axis("off")
            if c >= len(picks):  # a model with fewer applications than the widest row: no empty panel
                ax.set_visible(False)
                continue
            field = maps[picks[c]]
            gh, gw = field.shape
            local = field[max(0, qy - 1): qy + 2, max(0, qx - 1): qx + 2].sum().item()
            summary[label]["local_3x3"].append(local)
            summary[label]["peak"].append(field.max().item())
            # the field on top of a dimmed image, the more opaque the more weight a cell has: the field is what
            # the panel shows, the image shows through where the query does not look
            ax.imshow(dimmed, cmap="gray", extent=(0, wid, hgt, 0), interpolation="nearest", vmin=0.0, vmax=1.0)
            weight = (field / max(vmax, 1e-12)).clamp(0, 1).numpy()
            drawn = ax.imshow(field.numpy(), cmap="inferno", alpha=0.35 + 0.6 * weight, extent=(0, gw * p, gh * p, 0),
                              interpolation="nearest", vmin=0.0, vmax=vmax)
            ax.add_patch(Rectangle((qx * p, qy * p), p, p, fill=False, edgecolor="cyan", lw=1.2))
            note = f"\n{UNTRAINED_NOTE}" if picks[c] in untrained.get(label, ()) else ""
            ax.set_title(f"{label}, application {picks[c]}\n3x3 mass {local:.2f}, peak {field.max().item():.2f}{note}",
                         fontsize=7)
    if drawn is not None:
        bar = fig.colorbar(drawn, ax=axes, shrink=0.8, aspect=30)
        bar.set_label("attention weight\n(heads averaged; one scale)", fontsize=8)
        bar.ax.tick_params(labelsize=7)
        bar.solids.set_alpha(1.0)
    fig.suptitle(f"attention of query cell (y={qy}, x={qx}) (cyan) over the patches, heads averaged", fontsize=9)
    return results.save_figure(fig, path), summary
