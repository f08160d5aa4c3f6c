"""Losses and metrics of the training recipe: top-k accuracy and the JaSMin attention regulariser."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["topk_correct", "jasmin_row_norm", "jasmin_penalty"]


def topk_correct(logits: Tensor, target: Tensor, ks: Sequence[int] = (1, 3, 5)) -> dict[int, Tensor]:
    """Number of samples whose label is among the top-k logits, for each k (k is capped at the class count)."""
    maxk = min(max(ks), logits.shape[-1])
    pred = logits.topk(maxk, dim=-1).indices  # (B, maxk)
    hit = pred.eq(target[:, None])  # (B, maxk)
    return {k: hit[:, : min(k, maxk)].any(dim=-1).sum() for k in ks}


def jasmin_row_norm(p: Tensor) -> Tensor:
    """JaSMin's estimate of the spectral norm of the softmax Jacobian `diag(p) - p p^T`, for each row of `p`.

    With the probabilities of a row sorted in decreasing order `p_(1) >= p_(2) >= ... >= p_(n)` and `p_(n+1) = 0`,
    `g_k(p) = p_(k) (1 - p_(k) + p_(k+1))` and the estimate is `max_k g_k(p)` (Yudin et al. 2025). It is exact for a
    uniform row (`1/n`), a one-hot row (`0`) and a two-point row (`1/2` for `(1/2, 1/2)`).

    Args:
        p: probabilities `(..., n)`, each row on the simplex.

    Returns:
        `(...)` one value per row.
    """
    s = p.sort(dim=-1, descending=True).values
    nxt = torch.cat([s[..., 1:], torch.zeros_like(s[..., :1])], dim=-1)
    return (s * (1.0 - s + nxt)).amax(dim=-1)


def jasmin_penalty(attn_maps: Sequence[Tensor], reduce: str = "mean") -> Tensor:
    """JaSMin regulariser over the attention maps of one forward pass.

    Args:
        attn_maps: one `(B, H, T, T)` row-stochastic map per mixer application (`ssogvit.models.record_attention`).
        reduce: `"mean"`: mean of the row estimates over rows, heads, maps and images (default; every row is pushed
            down a little); `"max"`: for each image the largest row estimate over all rows, heads and maps (the
            Lipschitz-relevant worst case), then the mean over images.
    """
    if reduce not in ("mean", "max"):
        raise ValueError(f"jasmin reduce must be 'mean' or 'max', got {reduce!r}")
    if not attn_maps:
        raise ValueError("JaSMin needs attention maps; the model returned none")
    rows = torch.stack([jasmin_row_norm(a.float()) for a in attn_maps], dim=1)  # (B, L, H, T)
    if reduce == "mean":
        return rows.mean()
    return rows.flatten(1).amax(dim=1).mean()
