"""``WindowAttention``: attention within non-overlapping windows of the patch grid (ViTDet), optionally shifted
(Swin); docs/models.md, "Local attention mixers"."""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor

from ssogvit import reference
from ssogvit.errors import InputError
from ssogvit.specs import DROP_RATE, EMBED_DIM, NUM_HEADS, Flag, Int, checked
from ssogvit.layers._local import LocalAttention

__all__ = ["WINDOW_SIZE", "WindowAttention"]

#: window side in grid cells
WINDOW_SIZE = Int(1, 1024)


class WindowAttention(LocalAttention):
    """Multi-head attention within ``window_size x window_size`` windows of the patch grid.

    Windows tile the grid from its top-left corner (ViTDet's window blocks); with ``shift_size = s`` the tiling starts
    ``s`` cells before the grid, so windows straddle the unshifted ones (Swin's shifted windows, which Swin alternates
    with unshifted ones block by block; ``create_model`` gives every block the same options, so a model of ours is
    all shifted or all unshifted, and mixes across windows through a ViT's ``global_blocks``). Computed as Swin does: the grid is
    padded at the bottom and right to whole windows, cyclically shifted by ``-s``, cut into windows, and a mask keeps
    each window's attention inside the cells that are neighbours on the unshifted grid and off the padding (padded
    cells are never attended to, so a grid that windows do not divide gives the same result as cutting the windows at
    its edge). Along an axis no longer than ``window_size`` the whole axis is one window and there is no shift
    (Swin's rule). The pattern, as a dense mask, is ``reference.window_mask``. Prefix tokens attend to every token
    and every patch also to the prefix tokens (``LocalAttention``).

    Args:
        dim: token width ``D``.
        num_heads: ``H``; must divide ``dim``.
        window_size: window side in grid cells.
        shift_size: shift of the windows in cells, ``0 <= shift_size < window_size``.
        qkv_bias: bias of the QKV projection.
        proj_bias: bias of the output projection.
        attn_drop: dropout on the attention probabilities.
        proj_drop: dropout after the output projection.
    """

    @checked
    def __init__(
        self,
        dim: Annotated[int, EMBED_DIM],
        num_heads: Annotated[int, NUM_HEADS] = 8,
        *,
        window_size: Annotated[int, WINDOW_SIZE] = 16,
        shift_size: Annotated[int, Int(0, 1023)] = 0,
        qkv_bias: Annotated[bool, Flag()] = True,
        proj_bias: Annotated[bool, Flag()] = True,
        attn_drop: Annotated[float, DROP_RATE] = 0.0,
        proj_drop: Annotated[float, DROP_RATE] = 0.0,
    ) -> None:
        if shift_size >= window_size:
            raise InputError(f"shift_size={shift_size}: expected 0 <= shift_size < window_size={window_size}",
                             argument="shift_size")
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        self.window_size = window_size
        self.shift_size = shift_size

    def windows(self, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((wh, ww), (sh, sw))``: the window and shift used on ``grid``, per axis."""
        w, s = self.window_size, self.shift_size
        (wh, sh), (ww, sw) = ((w, s) if g > w else (g, 0) for g in grid)
        return (wh, ww), (sh, sw)

    def mask(self, grid: tuple[int, int], num_prefix_tokens: int = 0) -> Tensor:
        window, shift = self.windows(grid)
        return reference.window_mask(grid, window, shift, num_prefix=num_prefix_tokens)

    def _attend_patches(self, q: Tensor, k: Tensor, v: Tensor, grid: tuple[int, int], p: int, drop: float) -> Tensor:
        (gh, gw), ((wh, ww), (sh, sw)) = grid, self.windows(grid)
        b, h, _, dh = q.shape
        nh, nw = -(-gh // wh), -(-gw // ww)
        ph, pw = nh * wh - gh, nw * ww - gw

        def to_windows(t: Tensor) -> Tensor:  # patches (B, H, N, dh) -> (B * nW, H, wh * ww, dh)
            t = F.pad(t[:, :, p:].reshape(b, h, gh, gw, dh), (0, 0, 0, pw, 0, ph))
            if sh or sw:
                t = torch.roll(t, shifts=(-sh, -sw), dims=(2, 3))
            t = t.reshape(b, h, nh, wh, nw, ww, dh).permute(0, 2, 4, 1, 3, 5, 6)
            return t.reshape(b * nh * nw, h, wh * ww, dh)

        qw, kw, vw = to_windows(q), to_windows(k), to_windows(v)
        mask = self._window_mask(grid) if ph or pw or sh or sw else None  # (nW, wh*ww, wh*ww)
        if p:
            kw = torch.cat([self._prefix_keys(k, p, nh * nw).reshape(b * nh * nw, h, p, dh), kw], dim=2)
            vw = torch.cat([self._prefix_keys(v, p, nh * nw).reshape(b * nh * nw, h, p, dh), vw], dim=2)
            if mask is not None:
                mask = torch.cat([mask.new_ones(nh * nw, wh * ww, p), mask], dim=2)
        if mask is not None:  # one mask per window, the same for every image and head
            mask = mask.unsqueeze(0).expand(b, -1, -1, -1).reshape(b * nh * nw, 1, *mask.shape[1:]).to(q.device)
        y = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, dropout_p=drop)  # (B * nW, H, wh*ww, dh)
        y = y.reshape(b, nh, nw, h, wh, ww, dh).permute(0, 3, 1, 4, 2, 5, 6).reshape(b, h, nh * wh, nw * ww, dh)
        if sh or sw:
            y = torch.roll(y, shifts=(sh, sw), dims=(2, 3))
        return y[:, :, :gh, :gw].reshape(b, h, gh * gw, dh)

    def _window_mask(self, grid: tuple[int, int]) -> Tensor:
        """``(nW, wh*ww, wh*ww)``: which cell of a window of the padded, shifted grid sees which. Two cells see each
        other when both lie on the grid and in the same window of the shifted tiling (``reference.window_mask``); a
        padded cell's row sees its whole window (its output is dropped; the row must not be empty)."""
        (gh, gw), ((wh, ww), (sh, sw)) = grid, self.windows(grid)
        nh, nw = -(-gh // wh), -(-gw // ww)

        def axis(length: int, w: int, s: int, n: int) -> tuple[Tensor, Tensor]:
            original = (torch.arange(n * w) + s) % (n * w)  # the unshifted cell at each position of the shifted grid
            return torch.div(original + w - s, w, rounding_mode="floor"), original < length

        (ry, vy), (rx, vx) = axis(gh, wh, sh, nh), axis(gw, ww, sw, nw)
        region = ry[:, None] * (nw * ww + ww) + rx[None, :]  # (nh*wh, nw*ww)
        valid = vy[:, None] & vx[None, :]

        def cut(t: Tensor) -> Tensor:  # (nh*wh, nw*ww) -> (nW, wh*ww)
            return t.reshape(nh, wh, nw, ww).permute(0, 2, 1, 3).reshape(nh * nw, wh * ww)

        region, valid = cut(region), cut(valid)
        same = region[:, :, None] == region[:, None, :]
        return (same & valid[:, None, :]) | ~valid[:, :, None]

    def flops(self, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, int]:
        """FLOPs of one image: every cell of the padded windows a query of ``wh * ww`` keys
        (``ssogvit.bench.flops``)."""
        (wh, ww), _ = self.windows(grid)
        cells = -(-grid[0] // wh) * wh * -(-grid[1] // ww) * ww
        return self._core_flops(cells, wh * ww, grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, window_size={self.window_size}, "
                f"shift_size={self.shift_size}")
