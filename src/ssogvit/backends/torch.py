"""The torch backend: CPU- and GPU-friendly implementations of the fixed and steered mixing of ``ssogvit.ops``.

docs/operator.md states what they compute ("Fixed mixing", "Steered mixing") and how they differ ("Backends"). This
file holds the tuning only: head chunks, in-place writes into one output buffer, a custom autograd function that
recomputes the x-pass in backward. Shapes use the letters of ``ssogvit.ops``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._common import add_prefix_grad, flush_tiny_product, functional_only, head_grads, prefix_pool, write_prefix_pool

__all__ = ["SMALL_MIX_TOKENS", "default_head_chunk", "default_mix_head_chunk", "mix_fixed", "mix_steered"]

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


def default_head_chunk(grid: tuple[int, int], heads: int, atoms: int, dim: int) -> int:
    """Heads per steered chunk so that one chunk's temporaries stay within about a third of the activation.

    Per token and head a chunk holds its kernel tables (``R * (Gh + Gw)`` entries) and, while the column pass's
    result is re-laid out for the row pass, two copies of it (``2 * R * dh``). At ViT widths that is one head at a time.
    """
    gh, gw = grid
    per_head = atoms * (gh + gw) + 2 * atoms * (dim // heads)
    return max(1, min(heads, dim // (3 * per_head)))


# ---------------------------------------------------------------------------------------------------------------------
# Fixed SSoG


def mix_fixed(
    values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor, *,
    impl: str, inplace: bool, head_chunk: int | None, grad_needed: bool,
) -> Tensor:
    """``ssogvit.ops.ssog_mix`` for ``impl`` in ``"stacked"``, ``"loop"``, ``"einsum"`` (arguments checked there)."""
    gh, gw = grid
    p = values.shape[1] - gh * gw
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

#: ``kernel_rows(length, query, mu, sigma, tau)``: per-token kernel rows, ``ssogvit.ops.token_axis_kernels``.
KernelRows = Callable[[int, Tensor, Tensor, Tensor, Tensor], Tensor]


def mix_steered(
    values: Tensor, grid: tuple[int, int], mu: Tensor, sigma: Tensor, lam: Tensor, tau: Tensor, *,
    head_chunk: int | None, inplace: bool, kernel_rows: KernelRows,
) -> Tensor:
    """``ssogvit.ops.ssog_mix_steered`` (arguments checked there), the per-token kernel rows built by ``kernel_rows``
    one head chunk at a time: the column pass and the row pass as batched matmuls."""
    b, t, d = values.shape
    gh, gw = grid
    p = t - gh * gw
    h, r = mu.shape[2], mu.shape[3]
    dh = d // h
    tau = tau.reshape(-1)
    tau = tau.expand(h) if tau.numel() == 1 else tau
    # query indices, laid out as the kernel tables below: y rows in (b, k, h, iy, r), x rows in (b, iy, h, ix, r)
    iy = torch.arange(gh, device=values.device).view(1, 1, 1, gh, 1)  # integers: kernel_rows picks the float dtype
    ix = torch.arange(gw, device=values.device).view(1, 1, 1, gw, 1)
    v = values[:, p:].view(b, gh, gw, h, dh)
    mu = mu.reshape(b, gh, gw, h, r, 2)
    sigma = sigma.reshape(b, gh, gw, h, r, 2)
    lam = lam.reshape(b, gh, gw, h, r)
    chunk = h if head_chunk is None else max(1, int(head_chunk))
    functional = functional_only()  # then each chunk's result is kept and concatenated, nothing written in place
    out_all = values if inplace else None if functional else values.new_empty(b, t, d)
    if not functional:
        write_prefix_pool(out_all, values, p)
    out = None if functional else out_all[:, p:].view(b, gh, gw, h, dh)
    chunks = []
    inference = not functional and not (
        torch.is_grad_enabled() and (mu.requires_grad or sigma.requires_grad or lam.requires_grad)
    )
    for h0 in range(0, h, chunk):
        hs = slice(h0, min(h, h0 + chunk))
        c = hs.stop - h0
        t = tau[hs].view(1, 1, c, 1, 1)
        # The small per-token geometry is permuted so that the kernel tables come out in the matmuls' layouts.
        col = (0, 2, 3, 1, 4)  # (b, iy, k, h, r) -> (b, k, h, iy, r): token (iy, k) steers row iy of column k
        ky = kernel_rows(
            gh, iy, mu[:, :, :, hs, :, 0].permute(col).contiguous(), sigma[:, :, :, hs, :, 0].permute(col), t
        ).to(values.dtype)  # (B, Gw, c, Gh, R, Gh)
        # column pass, batched over (b, k, h): ((iy, r), jy) @ (jy, d)
        v_b = v[:, :, :, hs].permute(0, 2, 3, 1, 4).reshape(b * gw * c, gh, dh)
        u = torch.bmm(ky.view(b * gw * c, gh * r, gh), v_b).view(b, gw, c, gh, r, dh)  # U[b, k, h, iy, r, d]
        del ky, v_b
        row = (0, 1, 3, 2, 4)  # (b, iy, ix, h, r) -> (b, iy, h, ix, r): the query steers its own row and mixture
        kx = kernel_rows(
            gw, ix, mu[:, :, :, hs, :, 1].permute(row).contiguous(), sigma[:, :, :, hs, :, 1].permute(row), t
        )  # (B, Gh, c, Gw, R, Gw)
        weights = lam[:, :, :, hs].permute(row)[..., None]
        kx = kx.mul_(weights) if inference else kx * weights
        # flushed in place in training too: this table is internal, and the gradient lost at flushed entries reaches
        # mu, sigma and lambda multiplied by a kernel value below tiny / lambda (see flush_tiny_product)
        tiny = torch.finfo(kx.dtype).tiny
        kx = (kx.masked_fill(kx < tiny, 0.0) if functional else kx.masked_fill_(kx < tiny, 0.0)).to(values.dtype)
        # row pass, batched over (b, iy, h): (ix, (r, k)) @ ((r, k), d)
        u_b = u.permute(0, 3, 2, 4, 1, 5).reshape(b * gh * c, r * gw, dh)
        del u
        y = torch.bmm(kx.view(b * gh * c, gw, r * gw), u_b).view(b, gh, c, gw, dh)
        del kx, u_b
        if functional:
            chunks.append(y.permute(0, 1, 3, 2, 4))
        else:
            out[:, :, :, hs] = y.permute(0, 1, 3, 2, 4)
    if functional:
        mixed = torch.cat(chunks, dim=3).reshape(b, gh * gw, d)
        return torch.cat([prefix_pool(values[:, p:], p), mixed], dim=1) if p else mixed
    return out_all
