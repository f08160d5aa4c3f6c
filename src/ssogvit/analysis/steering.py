"""Steering statistics of content-steered SSoG (docs/operator.md, docs/analysis.md): gate values, how far the centres
move, and the effective steering radius."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ssogvit import results

from ._common import capture_mixer_inputs, is_steered, mixer_rows


@torch.no_grad()
def steering_stats(model: nn.Module, images: Tensor) -> dict:
    """Gates and per-token geometry shifts of every steered mixer, measured on `images`.

    Per mixer (one row per block; one shared row for looped / ODE models):

    - `gates`: `s = softplus(alpha) + 1e-4` per steered path;
    - `effective_radius`: `s_mu * M`, the largest centre shift per axis the gate allows (grid cells);
    - `mean_delta_mu`, `max_delta_mu`: shift `|mu_t - mu|` of the atom centres per axis, averaged over (and largest
      among) images, tokens, heads, atoms and both axes, in grid cells (at most `effective_radius`);
    - `mean_log_sigma_ratio`: mean `|log(sigma_t / sigma)|`; `mean_lambda_tv`: mean total-variation distance between
      the steered and the fixed mixture;
    - `per_application`: `mean_delta_mu` of each call of the mixer (the shared block of a looped / ODE model is called
      once per step).

    Returns:
        `{"mixers": [...], "applications": [mean |delta mu| of every mixer call in forward order]}`.
    """
    model.eval()
    with capture_mixer_inputs(model) as records:
        model.forward_features(images)
    out = {"mixers": [], "applications": []}
    for (name, mixer), calls in zip(mixer_rows(model), records):
        if not is_steered(mixer):
            continue
        gates = {k: float(v) for k, v in mixer.gates().items()}
        base_mu, base_sigma, base_lam = mixer.mu, mixer.sigma(), mixer.mixture()
        shifts, log_ratio, tv, per_call = [], [], [], []
        for x, grid in calls:
            prefix = x.shape[1] - grid[0] * grid[1]
            mu, sigma, lam = mixer.geometry(x[:, prefix:])  # (B, N, H, R, 2), (B, N, H, R, 2), (B, N, H, R)
            shift = (mu - base_mu).abs().flatten()  # per (image, token, head, atom, axis)
            shifts.append(shift)
            per_call.append(shift.mean().item())
            log_ratio.append((sigma / base_sigma).log().abs().flatten())
            tv.append(0.5 * (lam - base_lam).abs().sum(-1).flatten())
        shifts, log_ratio, tv = torch.cat(shifts), torch.cat(log_ratio), torch.cat(tv)
        out["mixers"].append({
            "layer": name,
            "steer": list(mixer.steer),
            "gates": gates,
            "radius": float(mixer.radius),
            "effective_radius": gates.get("mu", 0.0) * float(mixer.radius),
            "mean_delta_mu": shifts.mean().item(),
            "max_delta_mu": shifts.max().item(),
            "mean_log_sigma_ratio": log_ratio.mean().item(),
            "mean_lambda_tv": tv.mean().item(),
            "per_application": per_call,
        })
        out["applications"] += per_call
    return out


def plot_steering(stats: dict, path: str | Path, *, title: str = "") -> Path | None:
    """Gates per mixer (log scale), and mean `|delta mu|` per mixer application with the effective radius."""
    rows = stats["mixers"]
    if not rows:
        return None
    plt = results.pyplot()
    fig, (ax_g, ax_m) = plt.subplots(1, 2, figsize=(10, 3.4))
    paths = ["mu", "sigma", "lambda"]
    width = 0.8 / len(paths)
    for k, p in enumerate(paths):
        vals = [r["gates"].get(p, float("nan")) for r in rows]
        ax_g.bar([i + (k - 1) * width for i in range(len(rows))], vals, width, label=f"s_{p}")
    ax_g.set_yscale("log")
    ax_g.set_xticks(range(len(rows)), [r["layer"].replace("block ", "") for r in rows], fontsize=7)
    ax_g.set_xlabel("mixer")
    ax_g.set_ylabel("gate s = softplus(α) + 1e-4")
    ax_g.legend(fontsize=7)
    ax_g.set_title("steering gates", fontsize=9)
    apps = stats["applications"]
    ax_m.plot(range(len(apps)), apps, "o-", ms=3, label="mean |Δμ| per axis (cells)")
    radii = []
    for r in rows:
        radii += [r["effective_radius"]] * len(r["per_application"])
    ax_m.plot(range(len(radii)), radii, "--", color="C3", label="effective radius s_μ·M")
    from matplotlib.ticker import MaxNLocator

    ax_m.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_m.set_xlabel("mixer application")
    ax_m.set_ylabel("grid cells")
    ax_m.set_ylim(bottom=0)  # shifts of thousandths of a cell and an untrained block's 0 on one linear axis
    ax_m.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_m.legend(fontsize=7)
    ax_m.set_title("how far steering moves the atom centres", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return results.save_figure(fig, path)
