"""``LocalAttention``: what window and neighbourhood attention share (docs/models.md, "Local attention mixers").

Prefix tokens (class, registers) attend to every token, and every patch attends to the prefix tokens besides the
patches of its own window or neighbourhood: the rule ViT-style models with a class token need (a window that hid the
class token would leave it unreachable). ``mask(grid, p)`` is the pattern as a dense ``(T, T)`` boolean from
``ssogvit.reference``; the fast paths never build it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssogvit import ops, reference
from ssogvit.layers.attention import Attention

__all__ = ["LocalAttention"]


class LocalAttention(Attention):
    """Attention whose patches see part of the grid (a subclass says which: ``mask`` and ``_attend_patches``);
    timm's parameter names (``qkv``, ``proj``), so a dense ViT's weights load unchanged."""

    def forward(
        self, x: Tensor, grid: tuple[int, int] | None = None, *, num_prefix_tokens: int | None = None
    ) -> Tensor:
        """Mix tokens ``(B, P + Gh*Gw, D)`` over the patch grid ``(Gh, Gw)`` (required); ``num_prefix_tokens`` as in
        ``Attention.forward``."""
        gh, gw, p = self._grid(x, grid, num_prefix_tokens)
        q, k, v = self._qkv(x, None, None)  # 3 x (B, H, T, dh)
        drop = self.attn_drop.p if self.training else 0.0
        y = self._attend_patches(q, k, v, (gh, gw), p, drop)  # (B, H, N, dh)
        if p:
            y = torch.cat([F.scaled_dot_product_attention(q[:, :, :p], k, v, dropout_p=drop), y], dim=2)
        return self._output(y)

    def attention_matrix(self, x: Tensor, grid: tuple[int, int] | None = None, *,
                         num_prefix_tokens: int | None = None) -> Tensor:
        """The ``(B, H, T, T)`` attention probabilities, from the dense masked definition (diagnostics, tests)."""
        gh, gw, p = self._grid(x, grid, num_prefix_tokens)
        q, k, _ = self._qkv(x, None, None)
        return reference.masked_attention_matrix(q, k, self.mask((gh, gw), p), self.scale)

    def mask(self, grid: tuple[int, int], num_prefix_tokens: int = 0) -> Tensor:
        """Which token sees which: ``(T, T)`` booleans, prefix tokens first."""
        raise NotImplementedError

    def _attend_patches(self, q: Tensor, k: Tensor, v: Tensor, grid: tuple[int, int], p: int, drop: float) -> Tensor:
        """The patches' outputs ``(B, H, N, dh)`` from all tokens' ``q, k, v (B, H, P + N, dh)``."""
        raise NotImplementedError

    def _grid(self, x: Tensor, grid: tuple[int, int] | None, num_prefix_tokens: int | None) -> tuple[int, int, int]:
        if x.ndim != 3:
            raise ValueError(f"{type(self).__name__} expects x of shape (B, P + Gh*Gw, D), got a {x.ndim}-D tensor "
                             f"{tuple(x.shape)}")
        if grid is None:
            raise ValueError(f"{type(self).__name__} needs the patch grid: call attn(x, grid=(Gh, Gw))")
        return ops.check_grid(x.shape[1], grid, num_prefix_tokens, max_implicit_prefix=1)

    @staticmethod
    def _prefix_keys(k: Tensor, p: int, groups: int) -> Tensor:
        """The prefix tokens' keys or values ``(B, H, P, dh)`` repeated for ``groups`` windows or tiles:
        ``(B, groups, H, P, dh)``."""
        return k[:, :, :p].unsqueeze(1).expand(-1, groups, -1, -1, -1)

    def _core_flops(self, patch_queries: int, keys_per_query: int, grid: tuple[int, int], p: int) -> dict[str, int]:
        """FLOPs (2 per multiply-add) of one image: the projections of every token, ``q k^T`` and ``a v`` for
        ``patch_queries`` patch rows of ``keys_per_query`` keys (prefix keys added) and the prefix rows over all."""
        d, t = self.dim, grid[0] * grid[1] + p
        core = 2 * patch_queries * (keys_per_query + p) * d + 2 * p * t * d
        out = {"projections": 2 * 4 * t * d * d, "core": 2 * core, "steering": 0}
        return out | {"total": sum(out.values())}
