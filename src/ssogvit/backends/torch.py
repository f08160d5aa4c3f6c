"""The torch backend: CPU- and GPU-friendly implementations of the fixed and steered mixing of ``ssogvit.ops``.

docs/operator.md states what they compute ("Fixed mixing", "Steered mixing") and how they differ ("Backends"). This
file holds the tuning only: head chunks, in-place writes into one output buffer, a custom autograd function that
recomputes the x-pass in backward. Shapes use the letters of ``ssogvit.ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor

from . import cpu
from ._common import (
    add_prefix_grad, flush_tiny_product, functional_only, gaussian_rows_grad, grid_offsets, head_grads, prefix_pool,
    write_prefix_pool,
)

__all__ = [
    "SLICE_BYTES", "SMALL_MIX_TOKENS", "TRAIN_CHUNK_BYTES", "batch_slices", "default_head_chunk",
    "default_mix_head_chunk", "mix_fixed", "mix_steered",
]

#: Below this many patch tokens in a batch (``B * N``), ``"stacked"`` mixes heads in chunks: its per-head matmuls
#: are then too small to keep two cores busy (measured on the 2-core CPU of docs/benchmarks.md, ViT-B width, mixing
#: alone: chunks of 2 heads take 0.70x the per-head time at 224 batch 1, 0.79x at 224 batch 2, 0.80x at 384 batch 1;
#: at 224 batch 4 and 384 batch 2 no gain; at 512 batch 1 two measurements disagreed, so the rule stops below it).
SMALL_MIX_TOKENS = 640


def default_mix_head_chunk(batch_tokens: int, heads: int, atoms: int) -> int:
    """Heads per chunk for the fixed mixing's forward (see ``ssogvit.ops.ssog_mix``'s ``head_chunk``)."""
    if batch_tokens > SMALL_MIX_TOKENS:
        return 1
    return max(1, heads // (atoms + 2))  # a chunk's temporaries: (atoms + 2) * chunk / heads activations


#: In training, a steered chunk may hold this many bytes of temporaries even where that is more than a third of the
#: activation: the step keeps ten and more activations per block for backward and every weight's gradient, so a
#: chunk this small does not move its peak, while fewer chunks mean fewer calls (measured, docs/benchmarks.md,
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


#: ``rows(delta, mu, scale, inplace=...)``: Gaussian kernel rows (``ssogvit.ops.gaussian_rows``).
Rows = Callable[..., Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# Fixed SSoG


def mix_fixed(
    values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor, *,
    impl: str, inplace: bool, head_chunk: int | None, grad_needed: bool, rows: Rows | None = None,
) -> Tensor:
    """``ssogvit.ops.ssog_mix`` for ``impl`` in ``"auto"`` (the C kernel of ``backends.cpu`` where it applies, else
    ``"stacked"``), ``"stacked"``, ``"loop"``, ``"einsum"`` (arguments checked there; ``rows`` is
    ``ssogvit.ops.gaussian_rows``, which the C kernel's first use is checked against: without it ``"auto"`` is
    ``"stacked"``)."""
    gh, gw = grid
    p = values.shape[1] - gh * gw
    if impl == "auto":
        if rows is not None and not grad_needed and cpu.mixes(values, (ky, kx, lam), rows):
            out = values if inplace else torch.empty_like(values)
            write_prefix_pool(out, values, p)  # before any patch row of ``out`` is overwritten
            cpu.fixed_mix(out, values, grid, ky, kx, lam)
            return out
        impl = "stacked"
    if impl == "stacked":
        h, r = lam.shape
        ky_fold = flush_tiny_product(ky * lam[:, :, None, None]).permute(0, 2, 3, 1).reshape(h, gh, gh * r)
        kx_stack = kx.reshape(h, r * gw, gw)  # rows (atom, ix)
        if grad_needed:
            return _StackedMix.apply(values, ky_fold, kx_stack, gh, gw)
        chunk = head_chunk or default_mix_head_chunk(values.shape[0] * gh * gw, h, r)
        return _stacked_forward(values, ky_fold, kx_stack, gh, gw, values if inplace else None, chunk)
    mix = _mix_loop if impl == "loop" else _mix_einsum
    mixed = mix(values[:, p:], grid, ky, kx, lam)
    return torch.cat([prefix_pool(values[:, p:], p), mixed], dim=1) if p else mixed


def _stacked_forward(
    values: Tensor, ky_fold: Tensor, kx_stack: Tensor, gh: int, gw: int, out: Tensor | None, chunk: int
) -> Tensor:
    """Forward of ``_StackedMix`` (also used directly without autograd). ``out`` may be ``values`` itself: each
    head's (or chunk's) values are read into temporaries before its result is written."""
    b, t, d = values.shape
    h = ky_fold.shape[0]
    r = kx_stack.shape[1] // gw
    dh = d // h
    p = t - gh * gw
    vp = values[:, p:].view(b, gh, gw, h, dh)
    if out is None:
        out = values.new_empty(b, t, d)
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


def _mix_einsum(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor) -> Tensor:
    b, n, d = values.shape
    gh, gw = grid
    h = ky.shape[0]
    v = values.reshape(b, gh, gw, h, d // h)
    u = torch.einsum("hrkl,bjlhd->bhrjkd", kx, v)  # x-pass, one copy per atom
    y = torch.einsum("hr,hrij,bhrjkd->bikhd", lam, ky, u)  # y-pass and mixture
    return y.reshape(b, n, d)


def _mix_loop(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor) -> Tensor:
    # Head-major, one atom at a time, accumulating into one buffer per head: x-pass as a right-multiplication
    # (B*Gh*dh, Gw) @ (Gw, Gw), y-pass as (Gh, Gh) @ (Gh, dh*Gw).
    b, n, d = values.shape
    gh, gw = grid
    h, r = lam.shape
    dh = d // h
    v = values.reshape(b, gh, gw, h, dh)
    kxt = kx.transpose(-1, -2)
    ky_l = ky * lam[:, :, None, None]
    out = values.new_empty(b, gh, gw, h, dh)
    for hi in range(h):
        vt = v[:, :, :, hi].transpose(-1, -2).reshape(b * gh * dh, gw)  # (B*Gh*dh, Gw): layout (b, jy, d, jx)
        acc = None
        for ri in range(r):
            u = (vt @ kxt[hi, ri]).view(b, gh, dh * gw)  # x-pass
            if acc is None:
                acc = torch.matmul(ky_l[hi, ri], u)  # y-pass, (B, Gh, dh*Gw)
            else:
                acc = acc.baddbmm(ky_l[hi, ri].expand(b, gh, gh), u)
        out[:, :, :, hi] = acc.view(b, gh, dh, gw).transpose(-1, -2)
    return out.view(b, n, d)


class _StackedMix(torch.autograd.Function):
    """Per head: the x-pass applies all atoms at once, ``(R*Gw, Gw)`` to each grid row, reading V in the tokens' own
    layout; the y-pass contracts (source row, atom) together, ``(Gh, Gh*R)`` with lambda folded in, so the sum over
    atoms happens inside the matmul. Temporaries are one head's worth (``R/H`` of the activation). The output is
    written in place into one ``(B, P + N, D)`` buffer, prefix rows included. Backward saves only the values and the
    kernels and recomputes the x-pass, so training keeps no per-atom intermediates.
    """

    @staticmethod
    def forward(ctx, values: Tensor, ky_fold: Tensor, kx_stack: Tensor, gh: int, gw: int) -> Tensor:
        out = _stacked_forward(values, ky_fold, kx_stack, gh, gw, None, 1)
        ctx.save_for_backward(values, ky_fold, kx_stack)
        ctx.grid = (gh, gw)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        values, ky_fold, kx_stack = ctx.saved_tensors
        gh, gw = ctx.grid
        b, t, d = values.shape
        h = ky_fold.shape[0]
        dh = d // h
        p = t - gh * gw
        vp = values[:, p:].view(b, gh, gw, h, dh)
        gp = grad[:, p:].reshape(b, gh, gw, h, dh)
        need_v, need_ky, need_kx = ctx.needs_input_grad[:3]
        g_values = values.new_zeros(b, t, d) if need_v else None
        g_ky = torch.zeros_like(ky_fold) if need_ky else None
        g_kx = torch.zeros_like(kx_stack) if need_kx else None
        gvp = g_values[:, p:].view(b, gh, gw, h, dh) if need_v else None
        for hi in range(h):
            g_ky_h, g_kx_h, g_v_h = head_grads(
                vp[:, :, :, hi].reshape(b * gh, gw, dh), gp[:, :, :, hi].reshape(b, gh, gw * dh), kx_stack[hi],
                ky_fold[hi], need_ky=need_ky, need_kx=need_kx, need_v=need_v,
            )
            if need_ky:
                g_ky[hi] = g_ky_h
            if need_kx:
                g_kx[hi] = g_kx_h
            if need_v:
                gvp[:, :, :, hi] = g_v_h.view(b, gh, gw, dh)
        if need_v:
            add_prefix_grad(g_values, grad, p)
        return g_values, g_ky, g_kx, None, None


# ---------------------------------------------------------------------------------------------------------------------
# Content-steered SSoG


class _Steered:
    """The steered mixing's operands in the layouts of its two batched matmuls (docs/operator.md, "Steered mixing").

    Column pass, batched over ``(b, k, h)``: ``((iy, r), jy) @ (jy, d)``, the y-rows steered by token ``(iy, k)``.
    Row pass, batched over ``(b, iy, h)``: ``(ix, (r, k)) @ ((r, k), d)``, the x-rows and weights steered by the query.
    """

    def __init__(self, values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor, rows: Rows):
        b, t, d = values.shape
        self.gh, self.gw = gh, gw = grid
        self.b, self.d, self.p = b, d, t - gh * gw
        self.h, self.r = mu.shape[2], mu.shape[3]
        self.dh = d // self.h
        self.rows, self.values, self.geo = rows, values, (mu, scale, lam)
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
        self.delta_y = grid_offsets(gh, pd, values.device)[:, None, :]
        self.delta_x = grid_offsets(gw, pd, values.device)[:, None, :]

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
        """Rows by the C kernel where it applies (in place, so no autograd: ``backends.cpu``), else by ``rows``."""
        k = cpu.steered_rows(mu, s, lam, self.rows) if inplace else None
        if k is not None:
            return k
        k = self.rows(delta, mu, s, inplace=inplace)
        if lam is None:
            return k
        return flush_tiny_product(k.mul_(lam) if inplace else k * lam)

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

    def functional_forward(self, chunk: int) -> Tensor:
        """All heads, concatenated, nothing written in place (traced or exported: see ``functional_only``)."""
        parts = [self.chunk_forward(hs, False) for hs in self.chunks(chunk)]
        mixed = torch.cat(parts, dim=2).permute(0, 1, 3, 2, 4).reshape(self.b, self.gh * self.gw, self.d)
        patches = self.v.reshape(self.b, self.gh * self.gw, self.d)
        return torch.cat([prefix_pool(patches, self.p), mixed], dim=1) if self.p else mixed


#: ``geometry(*inputs) -> (mu, scale, lam)``: each token's centres ``(B, N, H, R, 2)``, kernel scales
#: (``ssogvit.ops.kernel_scale``, the same shape) and mixture weights ``(B, N, H, R)``.
Geometry = Callable[..., tuple[Tensor, Tensor, Tensor]]


def mix_steered(
    values: Tensor, grid: tuple[int, int], geometry: Geometry, inputs: tuple[Tensor, ...], *,
    head_chunk: int | None, inplace: bool, rows: Rows,
) -> Tensor:
    """``ssogvit.ops.ssog_mix_steered_from`` (arguments checked there): the mixing steered by ``geometry(*inputs)``,
    one head chunk (and batch slice, ``batch_slices``) at a time. With autograd, ``_SteeredMix`` saves the values and
    ``inputs`` only; it recomputes the geometry and the kernel tables in backward."""
    if torch.is_grad_enabled() and not functional_only() and any(t.requires_grad for t in (values, *inputs)):
        return _SteeredMix.apply(values, grid, head_chunk, rows, geometry, *inputs)
    geo = geometry(*inputs)
    chunk = _chunk(geo, head_chunk)
    if functional_only():
        return _Steered(values, grid, *geo, rows).functional_forward(chunk)
    return _steered_into(values if inplace else torch.empty_like(values), values, grid, geo, rows, chunk)


def _chunk(geo: tuple[Tensor, Tensor, Tensor], head_chunk: int | None) -> int:
    heads = geo[0].shape[2]
    return heads if head_chunk is None else max(1, min(heads, int(head_chunk)))


#: A batch slice of a steered chunk keeps its temporaries (tables, the column pass's result and its re-layout)
#: within this many bytes, so that they stay in the CPU's caches between the passes (on the 2-core CPU of
#: docs/benchmarks.md, ViT-B width, inference: 768 px batch 8 took 684 ms unsliced, 453 ms in slices of three
#: images; 1024 px batch 8 1637 ms and 936 ms one image at a time; below 512 px batch 8 nothing is sliced).
SLICE_BYTES = 32 * 2**20


def batch_slices(values: Tensor, grid: tuple[int, int], geo: tuple[Tensor, Tensor, Tensor], chunk: int) -> list[slice]:
    """Batch slices for the steered mixing: as many images per slice as keep a head chunk's temporaries within
    ``SLICE_BYTES`` (at least one)."""
    b, (gh, gw), (h, r) = values.shape[0], grid, geo[0].shape[2:4]
    per_image = gh * gw * chunk * (r * (gh + gw) + 2 * r * (values.shape[-1] // h)) * values.element_size()
    step = max(1, min(b, SLICE_BYTES // per_image))
    return [slice(i, min(b, i + step)) for i in range(0, b, step)]


def _batch(geo: tuple[Tensor, Tensor, Tensor], bs: slice) -> tuple[Tensor, Tensor, Tensor]:
    """The geometry of the images ``bs``."""
    return tuple(t[bs] for t in geo)


def _steered_into(out: Tensor, values: Tensor, grid: tuple[int, int], geo: tuple[Tensor, Tensor, Tensor], rows: Rows,
                  chunk: int) -> Tensor:
    """The steered mixing written into ``out`` (the values themselves in place: each chunk's values are read for the
    last time before its result is written), prefix rows first; by the C kernel where it applies (``backends.cpu``),
    else one batch slice and head chunk at a time."""
    write_prefix_pool(out, values, values.shape[1] - grid[0] * grid[1])
    if cpu.steered_mix(out, values, grid, *geo, rows):
        return out
    for bs in batch_slices(values, grid, geo, chunk):
        op = _Steered(values[bs], grid, *_batch(geo, bs), rows)
        o = out[bs, op.p:].view(op.b, op.gh, op.gw, op.h, op.dh)
        for hs in op.chunks(chunk):
            o[:, :, :, hs] = op.chunk_forward(hs, True).permute(0, 1, 3, 2, 4)
    return out


class _SteeredMix(torch.autograd.Function):
    """Steered mixing that keeps for backward only the values and the geometry's ``inputs`` (the layer passes its
    normalised tokens, which the value projection keeps anyway, and the field's parameters). Backward recomputes the
    per-token geometry, then the kernel tables and the column pass one head chunk at a time, and differentiates the
    geometry with ``torch.autograd.grad``. It is written with differentiable operations (out of place when a graph is
    being built), so gradient penalties can differentiate it again."""

    @staticmethod
    def forward(ctx, values, grid, head_chunk, rows, geometry, *inputs):
        ctx.save_for_backward(values, *inputs)
        ctx.args = (grid, head_chunk, rows, geometry)
        ctx.autocast = _autocast_state()  # the recomputed geometry must be the one the forward used
        geo = geometry(*inputs)  # forward runs without grad
        return _steered_into(torch.empty_like(values), values, grid, geo, rows, _chunk(geo, head_chunk))

    @staticmethod
    def backward(ctx, grad: Tensor):
        values, *inputs = ctx.saved_tensors
        grid, head_chunk, rows, geometry = ctx.args
        create = torch.is_grad_enabled()  # create_graph=True: the saved inputs carry the outer graph, use them as is
        need = ctx.needs_input_grad[5:]
        if not create:
            inputs = [t.detach().requires_grad_(n) for t, n in zip(inputs, need)]
        with torch.enable_grad(), _autocast(ctx.autocast):
            geo = geometry(*inputs)
        used = geo if create else tuple(t.detach() for t in geo)
        done = None if create else cpu.steered_mix_grad(values, grad, grid, *used, rows)  # the C kernel, else:
        if done is not None:
            g_values, g_geo = done
            add_prefix_grad(g_values, grad, values.shape[1] - grid[0] * grid[1])
        else:
            chunk = _chunk(used, head_chunk)
            parts = [_steered_backward(_Steered(values[bs], grid, *_batch(used, bs), rows), grad[bs], chunk)
                     for bs in batch_slices(values, grid, used, chunk)]
            g_values, g_geo = parts[0] if len(parts) == 1 else _joined(parts)
        outs = [(o, g) for o, g in zip(geo, g_geo) if o.requires_grad]
        wanted = [i for i, n in enumerate(need) if n]
        g_in = [None] * len(inputs)
        if outs and wanted:
            found = torch.autograd.grad([o for o, _ in outs], [inputs[i] for i in wanted], [g for _, g in outs],
                                        allow_unused=True, create_graph=create)
            for i, g in zip(wanted, found):
                g_in[i] = g
        return g_values, None, None, None, None, *g_in


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")]


@contextmanager
def _autocast(state: list[tuple[str, bool, torch.dtype]]):
    """Autocast as it was in the forward (backward runs outside the caller's ``torch.autocast`` block)."""
    with ExitStack() as stack:
        for dev, enabled, dtype in state:
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
        yield


def _joined(parts: list) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The gradients of batch slices put together."""
    return torch.cat([p[0] for p in parts]), tuple(torch.cat([p[1][i] for p in parts]) for i in range(3))


def _steered_backward(op: _Steered, grad: Tensor, chunk: int) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
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
        gm, gs = gaussian_rows_grad(k, delta - mu_c, s_c, g_k, inplace=ip)
        g_mu.append(gm[..., 0])
        g_s.append(gs[..., 0])

    for hs in op.chunks(chunk):
        c = hs.stop - hs.start
        v_b = op.v_cols(hs)
        u_b = op.column_pass(op.k_y(hs, ip).to(dtype), v_b, c)  # K^y is rebuilt below, not kept meanwhile
        kx = op.k_x(hs, ip)
        w = flush_tiny_product(kx * op.lam[:, :, hs]).to(dtype)
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
    g_scale = token_major(g_sy, g_sx).reshape(b, gh * gw, h, r, 2).sum_to_size(scale.shape).to(scale.dtype)
    g_lam = torch.cat(g_lam, dim=2).permute(row_inv).reshape(lam.shape).to(lam.dtype)
    return g_values, (g_mu, g_scale, g_lam)
