"""The torch backend (``impl="stacked"``): the fixed and the steered mixing of ``ssogvit.core`` as batched matmuls.

docs/operator.md states what they compute ("Fixed mixing", "Steered mixing", "Backward") and how the backends differ
("Backends"). This file holds the tuning only: atoms stacked inside one matmul per pass, head chunks and batch slices,
results written into one output buffer; the backward recomputes what the forward does not keep. Every function here
is a pure function of tensors (``ssogvit.ops`` wires them into autograd); the backward functions are written with
differentiable operations, so a backward that builds a graph (a gradient penalty) can be differentiated again.
Shapes use the letters of ``ssogvit.core``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssogvit import core

from ._common import add_prefix_grad, head_grads, write_prefix_pool

__all__ = [
    "SLICE_BYTES", "SMALL_MIX_TOKENS", "TRAIN_CHUNK_BYTES", "batch_slices", "default_head_chunk",
    "default_mix_head_chunk", "fixed_backward", "fixed_forward", "steered_backward", "steered_forward",
    "unsupported",
]

#: Below this many patch tokens in a batch (``B * N``), the fixed mixing's forward mixes heads in chunks: its per-head
#: matmuls are then too small to keep two cores busy (measured on the 2-core CPU of docs/benchmarks-log.md, ViT-B width,
#: mixing alone: chunks of 2 heads take 0.70x the per-head time at 224 batch 1, 0.79x at 224 batch 2, 0.80x at 384
#: batch 1; at 224 batch 4 and 384 batch 2 no gain; at 512 batch 1 two measurements disagreed, so the rule stops
#: below it).
SMALL_MIX_TOKENS = 640


def default_mix_head_chunk(batch_tokens: int, heads: int, atoms: int) -> int:
    """Heads per chunk for the fixed mixing's forward (see ``ssogvit.ops.ssog_mix``'s ``head_chunk``)."""
    if batch_tokens > SMALL_MIX_TOKENS:
        return 1
    return max(1, heads // (atoms + 2))  # a chunk's temporaries: (atoms + 2) * chunk / heads activations


#: In training, a steered chunk may hold this many bytes of temporaries even where that is more than a third of the
#: activation: the step keeps ten and more activations per block for backward and every weight's gradient, so a
#: chunk this small does not move its peak, while fewer chunks mean fewer calls (measured, docs/benchmarks-log.md,
#: "Training steps": ViT-B width at 224 px, batch 1, the mixer's training step 33.6 ms with one head per chunk and
#: 28.0 with four, at the same peak).
TRAIN_CHUNK_BYTES = 2 * 2**20


def default_head_chunk(
    grid: tuple[int, int], heads: int, atoms: int, dim: int, *, batch: int = 1, training: bool = False,
    itemsize: int = 4,
) -> int:
    """Heads per steered chunk so that one chunk's temporaries stay within about a third of the activation, or, in
    training, within ``TRAIN_CHUNK_BYTES`` where that is more.

    Per token and head a chunk holds its kernel tables (``R * (Gh + Gw)`` entries) and, while the column pass's
    result is re-laid out for the row pass, two copies of it (``2 * R * dh``). At ViT widths that is one head at a
    time, and in training up to four at 224 px, batch 1.
    """
    gh, gw = grid
    per_head = atoms * (gh + gw) + 2 * atoms * (dim // heads)  # numbers per token
    budget = dim / 3
    if training:
        budget = max(budget, TRAIN_CHUNK_BYTES / (itemsize * batch * gh * gw))
    return max(1, min(heads, int(budget // per_head)))


def unsupported(kind: str, values: Tensor, *operands: Tensor, auto: bool) -> str | None:
    """The probe of ``ssogvit.ops``: this backend mixes anything (``None``: no reason against it)."""
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Fixed SSoG


def _fixed_tables(ky: Tensor, kx: Tensor, lam: Tensor) -> tuple[Tensor, Tensor]:
    """``(Kyl (H, Gh, Gh*R), Kx (H, R*Gw, Gw))``: the y-kernels with lambda folded in and flushed
    (``core.flush_tiny_product``), columns ``(jy, r)``, and the x-kernels of all atoms stacked, rows ``(r, ix)``."""
    h, r, gh, _ = ky.shape
    gw = kx.shape[-1]
    ky_fold = core.flush_tiny_product(ky * lam[:, :, None, None]).permute(0, 2, 3, 1).reshape(h, gh, gh * r)
    return ky_fold, kx.reshape(h, r * gw, gw)


def fixed_forward(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor, *,
                  inplace: bool = False, head_chunk: int | None = None) -> Tensor:
    """``ssogvit.ops.ssog_mix`` (arguments checked there): per head (or chunk of ``head_chunk`` heads), all atoms in
    one ``(R*Gw, Gw)`` x-pass matmul reading V in place, then the y-pass contracting (source row, atom) together with
    lambda folded in, so that the sum over atoms happens inside the matmul. ``inplace`` writes the result over
    ``values``: each head's values are read into temporaries before its result is written."""
    gh, gw = grid
    ky_fold, kx_stack = _fixed_tables(ky, kx, lam)
    chunk = head_chunk or default_mix_head_chunk(values.shape[0] * gh * gw, *lam.shape)
    b, t, d = values.shape
    h, r = lam.shape
    dh = d // h
    p = t - gh * gw
    vp = values[:, p:].view(b, gh, gw, h, dh)
    out = values if inplace else values.new_empty(b, t, d)
    write_prefix_pool(out, values, p)
    op = out[:, p:].view(b, gh, gw, h, dh)
    if chunk <= 1:
        for hi in range(h):
            u = torch.matmul(kx_stack[hi], vp[:, :, :, hi])  # (B, Gh, R*Gw, dh): layout (b, jy, r, ix, d)
            y = torch.matmul(ky_fold[hi], u.view(b, gh * r, gw * dh))  # (B, Gh, Gw*dh)
            del u
            op[:, :, :, hi] = y.view(b, gh, gw, dh)
        return out
    for h0 in range(0, h, chunk):
        hs = slice(h0, min(h, h0 + chunk))
        c = hs.stop - h0
        v_c = vp[:, :, :, hs].permute(3, 0, 1, 2, 4).reshape(c, b * gh, gw, dh)  # a copy, head-major
        u = torch.matmul(kx_stack[hs, None], v_c)  # (c, B*Gh, R*Gw, dh): one batched matmul for the chunk
        del v_c
        if b == 1:
            y = torch.bmm(ky_fold[hs], u.view(c, gh * r, gw * dh))
        else:
            y = torch.matmul(ky_fold[hs, None], u.view(c, b, gh * r, gw * dh))
        del u
        op[:, :, :, hs] = y.view(c, b, gh, gw, dh).permute(1, 2, 3, 0, 4)
    return out


def fixed_backward(grad: Tensor, values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``fixed_forward`` for ``values``, ``ky``, ``kx`` and ``lam`` given ``grad = dL/dout``
    (docs/operator.md, "Backward"): per head by ``head_grads``, the x-pass recomputed rather than saved; ``lam``
    and ``ky`` through ``Kyl`` (the flush passes the gradient through unchanged)."""
    gh, gw = grid
    b, t, d = values.shape
    h, r = lam.shape
    dh = d // h
    p = t - gh * gw
    ky_fold, kx_stack = _fixed_tables(ky, kx, lam)
    vp = values[:, p:].reshape(b, gh, gw, h, dh)
    gp = grad[:, p:].reshape(b, gh, gw, h, dh)
    g_values = values.new_zeros(b, t, d)
    gvp = g_values[:, p:].view(b, gh, gw, h, dh)
    g_kyl, g_kx = values.new_empty(h, gh, gh * r), values.new_empty(h, r * gw, gw)
    for hi in range(h):
        g_kyl[hi], g_kx[hi], g_v = head_grads(vp[:, :, :, hi].reshape(b * gh, gw, dh),
                                              gp[:, :, :, hi].reshape(b, gh, gw * dh), kx_stack[hi], ky_fold[hi])
        gvp[:, :, :, hi] = g_v.view(b, gh, gw, dh)
    add_prefix_grad(g_values, grad, p)
    g_kyl = g_kyl.view(h, gh, gh, r).permute(0, 3, 1, 2)  # (H, R, Gh, Gh)
    return g_values, g_kyl * lam[:, :, None, None], g_kx.view(h, r, gw, gw), (g_kyl * ky).sum(dim=(-1, -2))


# ---------------------------------------------------------------------------------------------------------------------
# Content-steered SSoG


class _Steered:
    """The steered mixing's operands in the layouts of its two batched matmuls (docs/operator.md, "Steered mixing").

    Column pass, batched over ``(b, k, h)``: ``((iy, r), jy) @ (jy, d)``, the y-rows steered by token ``(iy, k)``.
    Row pass, batched over ``(b, iy, h)``: ``(ix, (r, k)) @ ((r, k), d)``, the x-rows and weights steered by the query.
    """

    def __init__(self, values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor):
        b, t, d = values.shape
        self.gh, self.gw = gh, gw = grid
        self.b, self.d, self.p = b, d, t - gh * gw
        self.h, self.r = mu.shape[2], mu.shape[3]
        self.dh = d // self.h
        self.values, self.geo = values, (mu, scale, lam)
        self.v = values[:, self.p:].view(b, gh, gw, self.h, self.dh)
        mu = mu.reshape(b, gh, gw, self.h, self.r, 2)
        scale = scale.expand(b, gh * gw, self.h, self.r, 2).reshape(b, gh, gw, self.h, self.r, 2)
        col, row = (0, 2, 3, 1, 4), (0, 1, 3, 2, 4)  # (b, iy, k, h, r) -> (b, k, h, iy, r) / (b, iy, h, ix, r)
        # small per-token tensors, made contiguous in each pass's layout (with a row axis) so that the tables are too
        self.mu_y, self.s_y = (t[..., 0].permute(col).contiguous()[..., None] for t in (mu, scale))
        self.mu_x, self.s_x = (t[..., 1].permute(row).contiguous()[..., None] for t in (mu, scale))
        self.lam = lam.reshape(b, gh, gw, self.h, self.r).permute(row).contiguous()[..., None]  # (b, iy, h, ix, r, 1)
        pd = self.s_y.dtype
        # j - i for the query row i of each table row: (iy, r, jy) and (ix, r, k), exact integers
        self.delta_y = core.grid_offsets(gh, pd, values.device)[:, None, :]
        self.delta_x = core.grid_offsets(gw, pd, values.device)[:, None, :]

    def chunks(self, chunk: int):
        for h0 in range(0, self.h, chunk):
            yield slice(h0, min(self.h, h0 + chunk))

    def k_y(self, hs: slice, inplace: bool) -> Tensor:
        return self._table(self.delta_y, self.mu_y[:, :, hs], self.s_y[:, :, hs], None, inplace)  # (b,k,c,iy,r,jy)

    def k_x(self, hs: slice, inplace: bool) -> Tensor:
        return self._table(self.delta_x, self.mu_x[:, :, hs], self.s_x[:, :, hs], None, inplace)  # (b,iy,c,ix,r,k)

    def w_x(self, hs: slice, inplace: bool) -> Tensor:
        """The row pass's matrix ``lambda K^x``, flushed (docs/operator.md, "Denormals")."""
        return self._table(self.delta_x, self.mu_x[:, :, hs], self.s_x[:, :, hs], self.lam[:, :, hs], inplace)

    def _table(self, delta: Tensor, mu: Tensor, s: Tensor, lam: Tensor | None, inplace: bool) -> Tensor:
        k = core.gaussian_rows(delta, mu, s, inplace=inplace)
        if lam is None:
            return k
        return core.flush_tiny_product(k.mul_(lam) if inplace else k * lam)

    def v_cols(self, hs: slice) -> Tensor:
        c = hs.stop - hs.start
        return self.v[:, :, :, hs].permute(0, 2, 3, 1, 4).reshape(self.b * self.gw * c, self.gh, self.dh)

    def column_pass(self, ky: Tensor, v_b: Tensor, c: int) -> Tensor:
        """``U`` re-laid out for the row pass: ``(b*Gh*c, R*Gw, dh)``, rows ``(r, k)``."""
        b, gh, gw, r, dh = self.b, self.gh, self.gw, self.r, self.dh
        u = torch.bmm(ky.view(b * gw * c, gh * r, gh), v_b).view(b, gw, c, gh, r, dh)
        return u.permute(0, 3, 2, 4, 1, 5).reshape(b * gh * c, r * gw, dh)

    def chunk_forward(self, hs: slice, inplace: bool) -> Tensor:
        """Mixed patches of the heads ``hs``: ``(B, Gh, c, Gw, dh)``."""
        b, gh, gw, r, dh = self.b, self.gh, self.gw, self.r, self.dh
        c = hs.stop - hs.start
        dtype = self.v.dtype
        u_b = self.column_pass(self.k_y(hs, inplace).to(dtype), self.v_cols(hs), c)
        w = self.w_x(hs, inplace).to(dtype)
        return torch.bmm(w.view(b * gh * c, gw, r * gw), u_b).view(b, gh, c, gw, dh)


def _chunk(heads: int, head_chunk: int | None) -> int:
    return heads if head_chunk is None else max(1, min(heads, int(head_chunk)))


#: A batch slice of a steered chunk keeps its temporaries (tables, the column pass's result and its re-layout)
#: within this many bytes, so that they stay in the CPU's caches between the passes (on the 2-core CPU of
#: docs/benchmarks-log.md, ViT-B width, inference: 768 px batch 8 took 684 ms unsliced, 453 ms in slices of three
#: images; 1024 px batch 8 1637 ms and 936 ms one image at a time; below 512 px batch 8 nothing is sliced).
SLICE_BYTES = 32 * 2**20


def batch_slices(values: Tensor, grid: tuple[int, int], heads: int, atoms: int, chunk: int) -> list[slice]:
    """Batch slices for the steered mixing: as many images per slice as keep a head chunk's temporaries within
    ``SLICE_BYTES`` (at least one)."""
    b, (gh, gw) = values.shape[0], grid
    per_image = gh * gw * chunk * (atoms * (gh + gw) + 2 * atoms * (values.shape[-1] // heads)) * values.element_size()
    step = max(1, min(b, SLICE_BYTES // per_image))
    return [slice(i, min(b, i + step)) for i in range(0, b, step)]


def steered_forward(values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor, *,
                    inplace: bool = False, head_chunk: int | None = None) -> Tensor:
    """``ssogvit.ops.ssog_mix_steered`` (arguments checked there): one batch slice (``batch_slices``) and head chunk
    (``head_chunk`` heads; ``None``: all) at a time, written into a new buffer, or with ``inplace`` over the values
    (each chunk's values are read for the last time before its result is written), prefix rows first. ``mu`` and
    ``scale`` ``(B, N, H, R, 2)``, ``lam`` ``(B, N, H, R)``."""
    out = values if inplace else torch.empty_like(values)
    write_prefix_pool(out, values, values.shape[1] - grid[0] * grid[1])
    heads, atoms = mu.shape[2:4]
    chunk = _chunk(heads, head_chunk)
    tables_inplace = not torch.is_grad_enabled()
    for bs in batch_slices(values, grid, heads, atoms, chunk):
        op = _Steered(values[bs], grid, mu[bs], scale[bs], lam[bs])
        o = out[bs, op.p:].view(op.b, op.gh, op.gw, op.h, op.dh)
        for hs in op.chunks(chunk):
            o[:, :, :, hs] = op.chunk_forward(hs, tables_inplace).permute(0, 1, 3, 2, 4)
    return out


def steered_backward(grad: Tensor, values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor, *,
                     head_chunk: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``steered_forward`` for ``values``, ``mu``, ``scale`` and ``lam``
    given ``grad = dL/dout``, one batch slice and head chunk at a time, the tables and the column pass recomputed."""
    heads, atoms = mu.shape[2:4]
    chunk = _chunk(heads, head_chunk)
    parts = []
    for bs in batch_slices(values, grid, heads, atoms, chunk):
        op = _Steered(values[bs], grid, mu[bs], scale[bs], lam[bs])
        parts.append(_steered_backward(op, grad[bs], chunk))
    g_values, g_mu, g_scale, g_lam = (torch.cat([p[i] for p in parts]) for i in range(4))
    return g_values, g_mu, g_scale, g_lam


def _steered_backward(op: _Steered, grad: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the steered mixing ``op`` for its values and its geometry ``op.geo = (mu, scale, lam)``
    (docs/operator.md, "Backward"), recomputing the tables one head chunk at a time."""
    values, (mu, scale, lam) = op.values, op.geo
    b, gh, gw, h, r, dh = op.b, op.gh, op.gw, op.h, op.r, op.dh
    ip = not torch.is_grad_enabled()  # a graph is built (create_graph=True): no in-place ops then
    dtype = values.dtype
    g_out = grad[:, op.p:].reshape(b, gh, gw, h, dh)
    g_values = torch.zeros_like(values)
    g_v = g_values[:, op.p:].view(b, gh, gw, h, dh)
    g_muy, g_sy, g_mux, g_sx, g_lam = [], [], [], [], []  # per chunk, reduced over the rows

    def reduce(k, delta, mu_c, s_c, g_k, g_mu, g_s):
        gm, gs = core.gaussian_rows_grad(k, delta - mu_c, s_c, g_k, inplace=ip)
        g_mu.append(gm[..., 0])
        g_s.append(gs[..., 0])

    for hs in op.chunks(chunk):
        c = hs.stop - hs.start
        v_b = op.v_cols(hs)
        u_b = op.column_pass(op.k_y(hs, ip).to(dtype), v_b, c)  # K^y is rebuilt below, not kept meanwhile
        kx = op.k_x(hs, ip)
        w = core.flush_tiny_product(kx * op.lam[:, :, hs]).to(dtype)
        g_y = g_out[:, :, :, hs].permute(0, 1, 3, 2, 4).reshape(b * gh * c, gw, dh)
        g_w = torch.bmm(g_y, u_b.transpose(1, 2)).view(b, gh, c, gw, r, gw).to(kx.dtype)  # dL/d(lam * K^x)
        del u_b
        g_u = torch.bmm(w.view(b * gh * c, gw, r * gw).transpose(1, 2), g_y)  # (b*Gh*c, R*Gw, dh)
        del w
        g_lam.append((g_w * kx).sum(-1))
        g_kx = g_w.mul_(op.lam[:, :, hs]) if ip else g_w * op.lam[:, :, hs]
        del g_w
        reduce(kx, op.delta_x, op.mu_x[:, :, hs], op.s_x[:, :, hs], g_kx, g_mux, g_sx)
        del kx, g_kx
        g_u = g_u.view(b, gh, c, r, gw, dh).permute(0, 4, 2, 1, 3, 5).reshape(b * gw * c, gh * r, dh)
        ky = op.k_y(hs, ip)
        g_ky = torch.bmm(g_u, v_b.transpose(1, 2)).view(b, gw, c, gh, r, gh).to(ky.dtype)
        g_vb = torch.bmm(ky.to(dtype).view(b * gw * c, gh * r, gh).transpose(1, 2), g_u)  # (b*Gw*c, Gh, dh)
        del g_u
        g_v[:, :, :, hs] = g_vb.view(b, gw, c, gh, dh).permute(0, 3, 1, 2, 4)
        reduce(ky, op.delta_y, op.mu_y[:, :, hs], op.s_y[:, :, hs], g_ky, g_muy, g_sy)
        del ky, g_ky
    add_prefix_grad(g_values, grad, op.p)
    col_inv, row_inv = (0, 3, 1, 2, 4), (0, 1, 3, 2, 4)  # back to (b, iy, ix, h, r)

    def token_major(y_parts, x_parts):
        return torch.stack([torch.cat(y_parts, 2).permute(col_inv), torch.cat(x_parts, 2).permute(row_inv)], -1)

    g_mu = token_major(g_muy, g_mux).reshape(mu.shape).to(mu.dtype)
    g_scale = token_major(g_sy, g_sx).reshape(scale.shape).to(scale.dtype)
    g_lam = torch.cat(g_lam, dim=2).permute(row_inv).reshape(lam.shape).to(lam.dtype)
    return g_values, g_mu, g_scale, g_lam
