"""Losses and metrics of the training recipe: top-k accuracy and the attention regularisers.

Two regularisers of row-stochastic attention maps, both built on the per-row quantity of Yudin et al. (2025): with a
row sorted in decreasing order `p_(1) >= p_(2) >= ... >= p_(n)` and `p_(n+1) = 0`,
`g_k(p) = p_(k) (1 - p_(k) + p_(k+1))`.

- `jasmin_penalty`: JaSMin as the ODE-ViT baseline (Boned Riera et al. 2025) defines and trains it (docs/training.md).
- `softmax_jacobian_penalty`: `max_k g_k`, an estimate of the spectral norm of each row's softmax Jacobian, reduced by
  a mean or max over rows. It is not ODE-ViT's loss; it is kept as a named alternative (`loss.jasmin.kind`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .settings import JasminSettings

__all__ = [
    "topk_correct", "jasmin_g", "jasmin_penalty", "softmax_jacobian_estimate", "softmax_jacobian_penalty",
    "jasmin_options", "attention_penalty", "JASMIN_KINDS",
]

#: `loss.jasmin.kind` -> what is penalised.
JASMIN_KINDS = ("jasmin", "softmax-jacobian")


def topk_correct(logits: Tensor, target: Tensor, ks: Sequence[int] = (1, 3, 5)) -> dict[int, Tensor]:
    """Number of samples whose label is among the top-k logits, for each k (k is capped at the class count)."""
    maxk = min(max(ks), logits.shape[-1])
    pred = logits.topk(maxk, dim=-1).indices  # (B, maxk)
    hit = pred.eq(target[:, None])  # (B, maxk)
    return {k: hit[:, : min(k, maxk)].any(dim=-1).sum() for k in ks}


def _sorted_with_next(p: Tensor) -> tuple[Tensor, Tensor]:
    """Each row sorted in decreasing order, and the same shifted left by one with `p_(n+1) = 0`."""
    s = p.sort(dim=-1, descending=True).values  # (..., n)
    return s, torch.cat([s[..., 1:], torch.zeros_like(s[..., :1])], dim=-1)


def jasmin_g(p: Tensor, k: int) -> Tensor:
    """`g_k(p) = p_(k) (1 - p_(k) + p_(k+1))` of each row of `p` (`1 <= k <= n`).

    Args:
        p: probabilities `(..., n)`, each row on the simplex.
        k: rank, counted from 1 (the largest entry).

    Returns:
        `(...)` one value per row.
    """
    n = p.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"g_k needs 1 <= k <= {n} (the row length), got k={k}")
    s, nxt = _sorted_with_next(p)
    return s[..., k - 1] * (1.0 - s[..., k - 1] + nxt[..., k - 1])


def jasmin_penalty(attn_maps: Sequence[Tensor], k: int = 0, *, eps: float = 1e-12) -> Tensor:
    """JaSMin of the ODE-ViT baseline over the given attention maps (docs/training.md, "JaSMin").

    Each row's loss is `log g_1` (`k = 0`, ODE-ViT's Eq. 8) or `log(g_1 / g_k)` (`k >= 2`, Eq. 9), computed as
    `log(g_1 + eps)` and `log(g_1 + eps) - log(g_k + eps)`, so that a one-hot row (`g_1 = g_k = 0`) is finite: `log eps`
    under Eq. 8 and `0` under Eq. 9. Each map is reduced by the max over its rows (query tokens), then the mean over
    heads and images; several maps by their mean. Computed in float32 at least.

    Args:
        attn_maps: `(B, H, T, T)` row-stochastic maps, the ones to penalise (ODE-ViT penalises the last map of the
            trajectory only).
        k: `0` for Eq. 8, `k >= 2` for Eq. 9 (ODE-ViT trains with `k = 10`); `k` may not exceed `T`.
        eps: added to `g` inside the logarithms.

    Returns:
        A scalar.
    """
    if k == 1 or k < 0:
        raise ValueError(f"JaSMin k must be 0 (Eq. 8) or >= 2 (Eq. 9), got k={k}")
    if not attn_maps:
        raise ValueError("JaSMin needs attention maps; the model returned none")
    losses = []
    for a in attn_maps:
        if a.ndim != 4 or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"JaSMin expects (B, H, T, T) attention maps, got shape {tuple(a.shape)}")
        a = a if a.dtype == torch.float64 else a.float()
        row = torch.log(jasmin_g(a, 1) + eps)  # (B, H, T)
        if k >= 2:
            row = row - torch.log(jasmin_g(a, k) + eps)
        losses.append(row.amax(dim=-1).mean())  # max over rows, mean over heads and images
    return torch.stack(losses).mean()


def softmax_jacobian_estimate(p: Tensor) -> Tensor:
    """`max_k g_k(p)` of each row: an estimate of the spectral norm of the softmax Jacobian `diag(p) - p p^T`.

    Exact for a uniform row (`1/n`), a one-hot row (`0`) and a two-point row (`1/2` for `(1/2, 1/2)`).

    Args:
        p: probabilities `(..., n)`, each row on the simplex.

    Returns:
        `(...)` one value per row.
    """
    s, nxt = _sorted_with_next(p)
    return (s * (1.0 - s + nxt)).amax(dim=-1)


def softmax_jacobian_penalty(attn_maps: Sequence[Tensor], *, reduce: str = "mean") -> Tensor:
    """The softmax-Jacobian estimate over attention maps: the alternative to `jasmin_penalty` (not ODE-ViT's loss).

    Args:
        attn_maps: `(B, H, T, T)` row-stochastic maps (`ssogvit.models.record_attention` records them).
        reduce: `"mean"`: mean of the row estimates over rows, heads, maps and images; `"max"`: for each image the
            largest row estimate over all rows, heads and maps, then the mean over images.
    """
    if reduce not in ("mean", "max"):
        raise ValueError(f"softmax-jacobian reduce must be 'mean' or 'max', got {reduce!r}")
    if not attn_maps:
        raise ValueError("the softmax-Jacobian penalty needs attention maps; the model returned none")
    rows = torch.stack([softmax_jacobian_estimate(a.float()) for a in attn_maps], dim=1)  # (B, L, H, T)
    if reduce == "mean":
        return rows.mean()
    return rows.flatten(1).amax(dim=1).mean()


def jasmin_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Checked options of `attention_penalty` from the `loss.jasmin` config block (weight excluded).

    Keys: `kind` (`"jasmin"` or `"softmax-jacobian"`), `k` (JaSMin only), `maps` (`"last"`: the last attention map
    of the forward pass, or `"all"`: the mean over every map), `reduce` (softmax-jacobian only; `"mean"` or `"max"`);
    a key left out takes its declared default (`ssogvit.train.settings.JasminSettings`).
    """
    defaults = dataclasses.asdict(JasminSettings())  # the declared defaults: a key left out takes its own
    unknown = sorted(set(cfg) - set(defaults))
    if unknown:
        raise ValueError(f"unknown loss.jasmin keys {unknown}; expected some of {sorted(defaults)}")
    options = {**defaults, **cfg}
    kind = str(options["kind"])
    if kind not in JASMIN_KINDS:
        raise ValueError(f"loss.jasmin.kind must be one of {JASMIN_KINDS}, got {kind!r}")
    maps = str(options["maps"])
    if maps not in ("last", "all"):
        raise ValueError(f"loss.jasmin.maps must be 'last' or 'all', got {maps!r}")
    k = int(options["k"])
    if k == 1 or k < 0:
        raise ValueError(f"loss.jasmin.k must be 0 (Eq. 8) or >= 2 (Eq. 9), got {k}")
    reduce = str(options["reduce"])
    if reduce not in ("mean", "max"):
        raise ValueError(f"loss.jasmin.reduce must be 'mean' or 'max', got {reduce!r}")
    return {"kind": kind, "k": k, "maps": maps, "reduce": reduce}


def attention_penalty(attn_maps: Sequence[Tensor], *, kind: str, k: int, maps: str, reduce: str) -> Tensor:
    """The regulariser that `loss.jasmin` selects (options as returned by `jasmin_options`), over one forward's maps."""
    if not attn_maps:
        raise ValueError("the attention regulariser needs attention maps; the model returned none")
    chosen = list(attn_maps[-1:]) if maps == "last" else list(attn_maps)
    if kind == "jasmin":
        return jasmin_penalty(chosen, k)
    return softmax_jacobian_penalty(chosen, reduce=reduce)
