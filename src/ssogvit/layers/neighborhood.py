"""``NeighborhoodAttention``: each patch attends to the ``k x k`` patches around it (NATTEN's neighbourhood
attention, Hassani et al. 2023), through torch's ``flex_attention`` where it runs and a tiled masked SDPA elsewhere;
docs/models.md, "Local attention mixers"."""

from __future__ import annotations

from functools import cache, lru_cache
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor

from ssogvit import reference
from ssogvit.errors import InputError
from ssogvit.specs import DROP_RATE, EMBED_DIM, NUM_HEADS, Choice, Flag, Int, checked
from ssogvit.layers._local import LocalAttention

__all__ = ["KERNEL_SIZE", "NEIGHBORHOOD_IMPLS", "NeighborhoodAttention"]

#: neighbourhood side in grid cells (odd)
KERNEL_SIZE = Int(1, 1023)
#: ``auto``: flex where it is compiled, tiled otherwise; ``flex``: compiled flex_attention; ``tiled``: masked SDPA
NEIGHBORHOOD_IMPLS = ("auto", "flex", "tiled")


def _axis_start(i: Tensor, length: int, k: int) -> Tensor:
    """First cell of the neighbourhood of cells ``i`` along an axis of ``length`` (NATTEN's clamped window)."""
    return (i - k // 2).clamp(0, length - k)


class NeighborhoodAttention(LocalAttention):
    """Multi-head attention of each patch over the ``kernel_size x kernel_size`` patches around it.

    The neighbourhood is NATTEN's: centred on the query and moved inside the grid at its border, so every patch sees
    exactly ``k * k`` patches (rows ``clamp(y - k // 2, 0, Gh - k)`` on, the same along ``x``; along an axis shorter
    than ``k``, the whole axis). The pattern, as a dense mask, is ``reference.neighborhood_mask``. Prefix tokens attend
    to every token and every patch also to the prefix tokens (``LocalAttention``).

    Two implementations, the same function (tested against the dense mask):

    - ``"flex"``: ``torch.nn.attention.flex_attention`` with a block mask, compiled (``torch.compile``; the eager
      flex_attention materialises the full score matrix). Needs a working ``torch.compile`` (a C++ compiler on CPU,
      Triton on CUDA), compiles once per grid (tens of seconds on CPU), no attention dropout.
    - ``"tiled"``: the grid cut into square tiles of ``(k + 1) // 2`` cells; each tile's queries attend, through
      ``F.scaled_dot_product_attention`` with a mask, to the halo of ``tile + k - 1`` cells that holds all their
      neighbourhoods. Runs everywhere (eager CPU, float64, dropout, export); each query meets ``(tile + k - 1)^2``
      keys instead of ``k^2`` (2x the multiply-adds of the definition for ``k = 7``).

    torch's flex_attention has no backward on CPU. ``"auto"`` takes flex on CUDA and, without a backward, inside
    ``torch.compile`` on CPU (the surrounding compile fuses it); tiled otherwise (eager CPU, training on CPU) and
    wherever flex cannot (attention dropout in training).

    Args:
        dim: token width ``D``.
        num_heads: ``H``; must divide ``dim``.
        kernel_size: neighbourhood side ``k`` in grid cells, odd.
        impl: ``"auto"``, ``"flex"`` or ``"tiled"`` (above).
        qkv_bias: bias of the QKV projection.
        proj_bias: bias of the output projection.
        attn_drop: dropout on the attention probabilities (tiled only).
        proj_drop: dropout after the output projection.
    """

    @checked
    def __init__(
        self,
        dim: Annotated[int, EMBED_DIM],
        num_heads: Annotated[int, NUM_HEADS] = 8,
        *,
        kernel_size: Annotated[int, KERNEL_SIZE] = 7,
        impl: Annotated[str, Choice(NEIGHBORHOOD_IMPLS)] = "auto",
        qkv_bias: Annotated[bool, Flag()] = True,
        proj_bias: Annotated[bool, Flag()] = True,
        attn_drop: Annotated[float, DROP_RATE] = 0.0,
        proj_drop: Annotated[float, DROP_RATE] = 0.0,
    ) -> None:
        if kernel_size % 2 == 0:
            raise InputError(f"kernel_size={kernel_size}: expected an odd integer (the query at the centre)",
                             argument="kernel_size")
        if impl == "flex" and attn_drop > 0:
            raise InputError(f"attn_drop={attn_drop}: flex_attention has no attention dropout; use impl='tiled' "
                             "or 'auto'", argument="attn_drop")
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        self.kernel_size = kernel_size
        self.impl = impl

    def kernel(self, grid: tuple[int, int]) -> tuple[int, int]:
        """``(kh, kw)``: the neighbourhood on ``grid`` (the whole axis where it is shorter than the kernel)."""
        return min(self.kernel_size, grid[0]), min(self.kernel_size, grid[1])

    def mask(self, grid: tuple[int, int], num_prefix_tokens: int = 0) -> Tensor:
        return reference.neighborhood_mask(grid, self.kernel(grid), num_prefix=num_prefix_tokens)

    def uses_flex(self, device: torch.device, *, drop: float = 0.0, grad: bool = False) -> bool:
        """Whether a call on ``device`` (with attention dropout ``drop``, needing a backward with ``grad``) runs
        flex_attention."""
        if self.impl != "auto":
            return self.impl == "flex"
        if torch.compiler.is_exporting() or torch.jit.is_tracing():  # no exporter keeps flex_attention's kernel
            return False
        cuda = device.type == "cuda"
        return drop == 0.0 and (cuda or (torch.compiler.is_compiling() and not grad))

    def forward(
        self, x: Tensor, grid: tuple[int, int] | None = None, *, num_prefix_tokens: int | None = None
    ) -> Tensor:
        """Mix tokens ``(B, P + Gh*Gw, D)`` over the patch grid ``(Gh, Gw)`` (required); ``num_prefix_tokens`` as in
        ``Attention.forward``."""
        drop = self.attn_drop.p if self.training else 0.0
        grad = torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in self.parameters()))
        if not self.uses_flex(x.device, drop=drop, grad=grad):
            return super().forward(x, grid, num_prefix_tokens=num_prefix_tokens)
        if grad and x.device.type == "cpu":
            raise ValueError("impl='flex': torch's flex_attention has no backward on CPU; use impl='auto' or 'tiled' "
                             "to train there")
        gh, gw, p = self._grid(x, grid, num_prefix_tokens)
        q, k, v = self._qkv(x, None, None)  # 3 x (B, H, T, dh)
        flex = _flex_attention(compiled=not torch.compiler.is_compiling())
        return self._output(flex(q, k, v, block_mask=_block_mask((gh, gw), p, self.kernel((gh, gw)), str(x.device))))

    def _attend_patches(self, q: Tensor, k: Tensor, v: Tensor, grid: tuple[int, int], p: int, drop: float) -> Tensor:
        (gh, gw), (kh, kw) = grid, self.kernel(grid)
        b, h, _, dh = q.shape
        (ty, ly, hy), (tx, lx, hx) = _tiles(gh, kh, q.device), _tiles(gw, kw, q.device)
        nty, ntx = hy.shape[0], hx.shape[0]
        qg = F.pad(q[:, :, p:].reshape(b, h, gh, gw, dh), (0, 0, 0, ntx * tx - gw, 0, nty * ty - gh))
        qt = qg.reshape(b, h, nty, ty, ntx, tx, dh).permute(0, 1, 2, 4, 3, 5, 6).reshape(b * h, nty * ntx, ty * tx, dh)

        def halo(t: Tensor) -> Tensor:  # patches (B, H, N, dh) -> (B * H, tiles, ly * lx, dh), each tile's halo
            t = t[:, :, p:].reshape(b, h, gh, gw, dh)[:, :, hy][:, :, :, :, hx]  # (B, H, nty, ly, ntx, lx, dh)
            return t.permute(0, 1, 2, 4, 3, 5, 6).reshape(b * h, nty * ntx, ly * lx, dh)

        kt, vt = halo(k), halo(v)
        my, mx = _tile_mask(gh, kh, ty, hy), _tile_mask(gw, kw, tx, hx)  # (tiles, tile, halo) per axis
        mask = my[:, None, :, None, :, None] & mx[None, :, None, :, None, :]
        mask = mask.reshape(1, nty * ntx, ty * tx, ly * lx)
        if p:
            kt = torch.cat([self._prefix_keys(k, p, nty * ntx).transpose(1, 2).reshape(b * h, nty * ntx, p, dh), kt], 2)
            vt = torch.cat([self._prefix_keys(v, p, nty * ntx).transpose(1, 2).reshape(b * h, nty * ntx, p, dh), vt], 2)
            mask = torch.cat([mask.new_ones(1, nty * ntx, ty * tx, p), mask], dim=3)
        y = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, dropout_p=drop)  # (B*H, tiles, ty*tx, dh)
        y = y.reshape(b, h, nty, ntx, ty, tx, dh).permute(0, 1, 2, 4, 3, 5, 6).reshape(b, h, nty * ty, ntx * tx, dh)
        return y[:, :, :gh, :gw].reshape(b, h, gh * gw, dh)

    def flops(self, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, int]:
        """FLOPs of one image by the definition, ``k * k`` keys per patch (``ssogvit.bench.flops``); the tiled
        implementation does about twice that in the core, flex's block-sparse kernel somewhat more."""
        kh, kw = self.kernel(grid)
        return self._core_flops(grid[0] * grid[1], kh * kw, grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, impl={self.impl}"


def _tiles(length: int, k: int, device: torch.device) -> tuple[int, int, Tensor]:
    """Tiling of an axis: tile side, halo side and the halo's cells ``(tiles, halo)``; the halo of a tile holds the
    neighbourhoods of all its cells (padded cells past the end included: theirs is the last one)."""
    tile = min(length, max(1, (k + 1) // 2))
    side = min(length, tile + k - 1)
    first = (torch.arange(0, length, tile, device=device) - k // 2).clamp(0, length - side)
    return tile, side, first[:, None] + torch.arange(side, device=device)


def _tile_mask(length: int, k: int, tile: int, halo: Tensor) -> Tensor:
    """``(tiles, tile, halo)``: whether the tile's ``r``-th cell has the halo's ``l``-th cell in its neighbourhood."""
    cells = torch.arange(halo.shape[0] * tile, device=halo.device).reshape(-1, tile)  # (tiles, tile)
    start = _axis_start(cells, length, k)[:, :, None]
    return (halo[:, None, :] >= start) & (halo[:, None, :] < start + k)


@cache
def _flex_attention(*, compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@lru_cache(maxsize=16)
def _block_mask(grid: tuple[int, int], p: int, kernel: tuple[int, int], device: str):
    """flex_attention's block mask of the neighbourhood pattern with ``p`` global prefix tokens (kept per grid)."""
    from torch.nn.attention.flex_attention import create_block_mask

    (gh, gw), (kh, kw) = grid, kernel

    def inside(b, h, q_idx, kv_idx):
        qp, kp = (q_idx - p).clamp_min(0), (kv_idx - p).clamp_min(0)
        qy, qx, ky, kx = qp // gw, qp % gw, kp // gw, kp % gw
        sy, sx = _axis_start(qy, gh, kh), _axis_start(qx, gw, kw)
        near = (ky >= sy) & (ky < sy + kh) & (kx >= sx) & (kx < sx + kw)
        return (q_idx < p) | (kv_idx < p) | near

    t = p + gh * gw
    return create_block_mask(inside, None, None, t, t, device=device)
