"""Effective number of atoms: how many Gaussians a head really uses (docs/analysis.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssogvit import results
from ssogvit.layers import is_ssog

from ._common import mixer_rows, untrained_field_mixers


def effective_atoms(weights: Tensor) -> Tensor:
    """`exp(entropy(lambda))` over the last axis, entropy in nats.

    Args:
        weights: mixture weights on the simplex, shape `(..., R)`.

    Returns:
        Shape `(...)`: `R` for uniform weights, 1 for a one-hot mixture.
    """
    w = weights.double()
    entropy = -torch.special.xlogy(w, w).sum(-1)  # 0 log 0 = 0
    return entropy.exp().to(weights.dtype if weights.is_floating_point() else torch.float64)


@torch.no_grad()
def atoms_report(model: nn.Module) -> dict:
    """Effective atoms per head and per mixer of `model`, and their mean.

    Returns:
        `{"num_atoms": R, "layers": [{"layer": name, "per_head": [...], "mean": m, "untrained": bool}, ...],
        "mean": m}` (`untrained`: a field no loss can train, `untrained_field_mixers`); only the SSoG mixers appear
        (an MHA model has no atoms and gives an empty list and a `None` mean).
    """
    layers, all_heads, num_atoms = [], [], None
    untrained = untrained_field_mixers(model)
    for i, (name, mixer) in enumerate(mixer_rows(model)):
        if not is_ssog(mixer):
            continue
        lam = mixer.mixture().detach()  # (H, R)
        num_atoms = lam.shape[-1]
        eff = effective_atoms(lam).tolist()
        all_heads += eff
        layers.append({"layer": name, "per_head": eff, "mean": sum(eff) / len(eff), "untrained": i in untrained})
    mean = sum(all_heads) / len(all_heads) if all_heads else None
    return {"num_atoms": num_atoms, "layers": layers, "mean": mean}


def plot_atoms(reports: dict[str, dict], path) -> object:
    """Heat map of effective atoms, one panel per model: rows are mixers, columns heads (1 = one atom, R = all); one
    colour scale for all panels, the quantity's whole range 1 to R, and each value printed in its cell."""
    reports = {k: r for k, r in reports.items() if r["layers"]}
    if not reports:
        return None
    plt = results.pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(4.4 * len(reports) + 0.8, 0.35 * max(
        len(r["layers"]) for r in reports.values()) + 1.6), squeeze=False, layout="constrained")
    # one colour scale for every panel: the quantity's whole range, 1 (one atom) to R (every atom equally). A scale
    # stretched over the values drawn (3.93 to 4.00) paints near-equal mixtures as opposites; each cell prints its
    # value for the differences the colours do not show
    low, high = 1.0, float(max(r["num_atoms"] for r in reports.values()))
    if high <= low:
        high = low + 1.0  # R = 1: every head has its one atom
    for ax, (label, rep) in zip(axes[0], reports.items()):
        grid = [row["per_head"] for row in rep["layers"]]
        im = ax.imshow(grid, vmin=low, vmax=high, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
            for h, v in enumerate(row):
                shade = "w" if v < low + 0.6 * (high - low) else "k"
                ax.text(h, i, f"{v:.3f}", ha="center", va="center", fontsize=6, color=shade)
        names = [row["layer"] + (" (untrained)" if row.get("untrained") else "") for row in rep["layers"]]
        ax.set_yticks(range(len(grid)), names, fontsize=7)
        ax.set_xticks(range(len(grid[0])), [f"h{h}" for h in range(len(grid[0]))], fontsize=7)
        ax.set_title(f"{label}: mean {rep['mean']:.2f} of R={rep['num_atoms']}", fontsize=8)
    bar = fig.colorbar(im, ax=list(axes[0]), fraction=0.03, pad=0.02)
    bar.set_label(f"effective atoms: 1 (one atom) to R = {high:g} (all equally)", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    fig.suptitle("effective atoms exp(H(λ)) per head", fontsize=9)
    return results.save_figure(fig, path)
