"""Triton kernel of the fixed-SSoG contraction, registered as the ops ``ssogvit::triton_fixed_mix`` and
``ssogvit::triton_fixed_mix_backward`` (``torch.library.triton_op``, so ``torch.compile`` and ``torch.export`` see the
kernel). Imported lazily by ``ssogvit.backends.triton`` (this module imports Triton).

One program computes one output grid row ``iy`` of one (batch, head) for a block of ``BD`` head channels:

    W[r, jx, d] = sum_jy Kyl[h, r, iy, jy] * V[b, jy, jx, h, d]         (y-pass, fp32 FMAs, one V tile per jy)
    Y[iy, ix, d] = sum_(r, jx) Kx[h, r, ix, jx] * W[r, jx, d]           (x-pass: one tl.dot, atoms stacked along K)

``Kyl = lambda * K^y``, flushed as ``core.flush_tiny_product`` flushes it (the mixture weights are applied as the kernel
rows are read). Where every source value is finite, the y-pass visits only the source rows ``[lo, hi)`` where some
atom's weighted kernel row is nonzero, found by the program itself (the softmax tails are exact zeros after the
denormal flush of docs/operator.md, "Denormals", or a cast to half precision), which skips exact-zero terms only;
where some value is NaN or infinite, every row, so that ``0 * inf`` is a NaN as in the torch path. The kernels are
read through strides, so the same kernel on transposed views is the gradient with respect to the values.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ssogvit import core

from ._common import add_prefix_grad, head_grads, tf32_enabled, write_prefix_pool

__all__ = ["OVERRIDE", "fits", "fixed_mix", "fixed_mix_backward", "launch_mix", "shared_bytes"]

#: Launch configuration forced by a tuning sweep: ``{"bd": channels per program (power of two >= 16), "warps": n}``.
#: Empty: chosen from the problem size.
OVERRIDE: dict = {}


@triton.jit
def _ssog_mix_kernel(
    v_ptr,  # source values, element (b, t, h*dh + d) at b * s_vb + t * s_vt + h * dh + d, tokens in raster order
    ky_ptr,  # y-kernels, element (h, r, i, j) at h * s_yh + r * s_yr + i * s_yi + j * s_yj (a transpose is free)
    kx_ptr,  # x-kernels, in the dot's dtype, element (h, r, i, j) at h * s_xh + r * s_xr + i * s_xi + j * s_xj
    lam_ptr,  # (H, R) contiguous mixture weights
    out_ptr,  # destination, same layout as v with its own strides
    finite_ptr,  # one bool: whether every source value is finite (else the y-pass visits every row)
    s_vb,
    s_vt,
    s_ob,
    s_ot,
    s_yh,
    s_yr,
    s_yi,
    s_yj,
    s_xh,
    s_xr,
    s_xi,
    s_xj,
    H,
    R,
    GH,
    GW,
    DH,
    GH_P: tl.constexpr,
    GW_P: tl.constexpr,
    R_P: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    TINY: tl.constexpr,
):
    pid = tl.program_id(0)  # (batch*head, row) flattened, rows fastest: neighbouring programs share source rows
    iy = pid % GH
    bh = pid // GH
    pd = tl.program_id(1)
    b = bh // H
    h = bh % H

    offs_r = tl.arange(0, R_P)
    offs_x = tl.arange(0, GW_P)
    offs_d = pd * BD + tl.arange(0, BD)
    mask_r = offs_r < R
    mask_x = offs_x < GW
    mask_d = offs_d < DH

    # lambda-weighted kernel row iy of every atom, flushed; its nonzero span [lo, hi) bounds the y-pass where every
    # value is finite (softmax tails are exact zeros after flush_tiny or a cast to half precision: only exact-zero
    # terms are skipped); else the y-pass visits every row
    lam = tl.load(lam_ptr + h * R + offs_r, mask=mask_r, other=0.0).to(ACC)  # (R_P,)
    k_rows = ky_ptr + h * s_yh + offs_r * s_yr + iy * s_yi  # (R_P,) pointers
    offs_j = tl.arange(0, GH_P)
    k_all = tl.load(k_rows[:, None] + offs_j[None, :] * s_yj, mask=mask_r[:, None] & (offs_j < GH)[None, :], other=0.0)
    kl_all = k_all.to(ACC) * lam[:, None]
    used = tl.max((tl.where(kl_all <= TINY, 0.0, kl_all) != 0).to(tl.int32), axis=0)  # (GH_P,)
    finite = tl.load(finite_ptr) != 0
    lo = tl.where(finite, tl.min(tl.where(used > 0, offs_j, GH_P), axis=0), 0)
    hi = tl.where(finite, tl.max(tl.where(used > 0, offs_j + 1, 0), axis=0), GH)

    v_base = v_ptr + b.to(tl.int64) * s_vb + h * DH
    tile_offs = offs_x[:, None] * s_vt + offs_d[None, :]  # (GW_P, BD)
    tile_mask = mask_x[:, None] & mask_d[None, :]
    row_stride = GW * s_vt
    v_row = v_base + lo.to(tl.int64) * row_stride + tile_offs  # (GW_P, BD) pointers into source row lo
    w = tl.zeros((R_P, GW_P, BD), dtype=ACC)
    for jy in range(lo, hi):
        k = tl.load(k_rows + jy * s_yj, mask=mask_r, other=0.0).to(ACC) * lam  # (R_P,)
        k = tl.where(k <= TINY, 0.0, k)
        v = tl.load(v_row, mask=tile_mask, other=0.0).to(ACC)
        w += k[:, None, None] * v[None, :, :]
        v_row += row_stride
    # padding (atoms beyond R, columns beyond Gw, channels beyond dh) must not carry 0 * inf into the x-pass
    w = tl.where(mask_r[:, None, None] & tile_mask[None, :, :], w, 0.0)

    # x-pass: (GW_P, R_P*GW_P) @ (R_P*GW_P, BD); column c of the stacked kernel is atom c // GW_P, source c % GW_P
    offs_c = tl.arange(0, R_P * GW_P)
    c_r = offs_c // GW_P
    c_x = offs_c % GW_P
    kx_offs = h * s_xh + c_r[None, :] * s_xr + offs_x[:, None] * s_xi + c_x[None, :] * s_xj
    kx_mask = mask_x[:, None] & (c_r < R)[None, :] & (c_x < GW)[None, :]
    kx = tl.load(kx_ptr + kx_offs, mask=kx_mask, other=0.0)
    w2 = tl.reshape(w, (R_P * GW_P, BD)).to(kx.dtype)
    y = tl.dot(kx, w2, input_precision=PRECISION, out_dtype=ACC)

    o_base = out_ptr + b.to(tl.int64) * s_ob + h * DH + iy.to(tl.int64) * GW * s_ot
    o_offs = offs_x[:, None] * s_ot + offs_d[None, :]
    tl.store(o_base + o_offs, y.to(out_ptr.dtype.element_ty), mask=tile_mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _config(gw: int, r: int, dh: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(GW_P, R_P, BD, warps)`` from the problem size (or ``OVERRIDE``)."""
    gw_p = max(16, _next_pow2(gw))
    r_p = _next_pow2(r)
    bd = max(16, min(_next_pow2(dh), 64))
    while bd > 16 and r_p * gw_p * bd > 16384:  # keep the fp32 y-pass tile W within a register budget
        bd //= 2
    warps = 8 if r_p * gw_p * bd > 8192 else 4  # about 64 fp32 registers of W per thread (not tuned on a GPU)
    if OVERRIDE:  # tuning sweeps (scripts/gpu_check.py)
        bd, warps = OVERRIDE.get("bd", bd), OVERRIDE.get("warps", warps)
    return gw_p, r_p, bd, warps


def shared_bytes(gw: int, r: int, dh: int, dtype: torch.dtype) -> int:
    """Estimated shared memory of one program: the x-pass operands ``(GW_P, R_P*GW_P)`` and ``(R_P*GW_P, BD)``
    (matches Triton 3.8's sm_90 compilation within a few KiB at the sizes checked)."""
    gw_p, r_p, bd, _ = _config(gw, r, dh, dtype)
    return torch.empty((), dtype=dtype).element_size() * r_p * gw_p * (gw_p + bd)


def fits(gw: int, r: int, dh: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel's shared memory fits the device (always true on CPU, i.e. under the interpreter)."""
    if device.type != "cuda":
        return True
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    return shared_bytes(gw, r, dh, dtype) <= limit


def _precision(dtype: torch.dtype) -> str:
    # fp32 follows torch's matmul setting (IEEE by default, as torch.matmul); fp64 is IEEE; fp16/bf16 ignore the
    # option (Triton's default string is passed)
    if dtype == torch.float32:
        return "tf32" if tf32_enabled() else "ieee"
    return "ieee" if dtype == torch.float64 else "tf32"


def launch_mix(src: Tensor, ky: Tensor, kx: Tensor, lam: Tensor, dst: Tensor, grid: tuple[int, int]) -> None:
    """Fixed-SSoG mixing of one value tensor into another:

    ``dst[b, (iy, ix), c] = sum_r lam[h, r] sum_(jy, jx) ky[h, r, iy, jy] kx[h, r, ix, jx] src[b, (jy, jx), c]``
    for each channel ``c = h*dh + d`` of head ``h``.

    Args:
        src, dst: ``(B, Gh*Gw, D)`` views whose last dimension is contiguous (strides of the first two are free).
        ky: ``(H, R, Gh, Gh)``, any strides (a transposed view is fine), any float dtype (read in the accumulator's).
        kx: ``(H, R, Gw, Gw)``, any strides, in ``src``'s dtype (the dot's operand dtype).
        lam: ``(H, R)``.
    """
    gh, gw = grid
    b, n, d = src.shape
    h, r = lam.shape
    dh = d // h
    assert n == gh * gw and src.stride(2) == 1 and dst.stride(2) == 1 and dst.shape == src.shape
    assert kx.dtype == src.dtype and tuple(ky.shape) == (h, r, gh, gh) and tuple(kx.shape) == (h, r, gw, gw)
    lam = lam.contiguous()
    finite = torch.isfinite(src).all()  # on the device: no synchronisation
    gh_p = _next_pow2(gh)
    gw_p, r_p, bd, warps = _config(gw, r, dh, src.dtype)
    acc = tl.float64 if src.dtype == torch.float64 else tl.float32
    launch_grid = (gh * b * h, triton.cdiv(dh, bd))
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        wrap_triton(_ssog_mix_kernel)[launch_grid](
            src, ky, kx, lam, dst, finite,
            src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            *ky.stride(), *kx.stride(),
            h, r, gh, gw, dh,
            GH_P=gh_p, GW_P=gw_p, R_P=r_p, BD=bd, PRECISION=_precision(src.dtype), ACC=acc,
            TINY=torch.finfo(src.dtype).tiny, num_warps=warps,
        )


@triton_op("ssogvit::triton_fixed_mix", mutates_args={})
def fixed_mix(values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor) -> Tensor:
    """``core.mix_fixed`` by the kernel: values ``(B, P + N, D)``, ky ``(H, R, Gh, Gh)``, kx ``(H, R, Gw, Gw)``, lam
    ``(H, R)``; the prefix rows get the mean patch value."""
    gh, gw = ky.shape[-1], kx.shape[-1]
    values = values.contiguous()
    p = values.shape[1] - gh * gw
    out = torch.empty_like(values)
    write_prefix_pool(out, values, p)
    launch_mix(values[:, p:], ky, kx.to(values.dtype), lam, out[:, p:], (gh, gw))
    return out


@triton_op("ssogvit::triton_fixed_mix_backward", mutates_args={})
def fixed_mix_backward(grad: Tensor, values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``triton_fixed_mix`` for ``values``, ``ky``, ``kx`` and ``lam`` given ``grad``: the kernel on
    transposed (strided) kernels gives the values' gradient; the kernels' gradients recompute the x-pass one head at a
    time in torch (``head_grads``)."""
    gh, gw = ky.shape[-1], kx.shape[-1]
    values, grad = values.contiguous(), grad.contiguous()
    b, t, d = values.shape
    h, r = lam.shape
    dh = d // h
    p = t - gh * gw
    g_values = torch.zeros_like(values)
    launch_mix(grad[:, p:], ky.transpose(-1, -2), kx.to(values.dtype).transpose(-1, -2), lam, g_values[:, p:],
               (gh, gw))
    add_prefix_grad(g_values, grad, p)
    kdt = torch.float64 if values.dtype == torch.float64 else torch.float32  # half-precision kernels: fp32 grads
    ky_k, lam_k = ky.to(kdt), lam.to(kdt)
    kyl = core.flush_tiny_product(ky_k * lam_k[:, :, None, None])  # the forward's factor, as the torch backend's
    kx_stack = kx.to(values.dtype).reshape(h, r * gw, gw)
    ky_fold = kyl.to(values.dtype).permute(0, 2, 3, 1).reshape(h, gh, gh * r)  # columns (jy, r)
    vp, gp = values[:, p:].reshape(b, gh, gw, h, dh), grad[:, p:].reshape(b, gh, gw, h, dh)
    g_kyl, g_kx = torch.zeros(h, gh, gh * r, dtype=kdt, device=values.device), torch.zeros(
        h, r * gw, gw, dtype=kdt, device=values.device)
    for hh in range(h):
        g_ky_h, g_kx_h, _ = head_grads(vp[:, :, :, hh].reshape(b * gh, gw, dh), gp[:, :, :, hh].reshape(b, gh, gw * dh),
                                       kx_stack[hh], ky_fold[hh], need_v=False, acc_dtype=kdt)
        g_kyl[hh], g_kx[hh] = g_ky_h, g_kx_h
    g_kyl = g_kyl.view(h, gh, gh, r).permute(0, 3, 1, 2)
    return (g_values, (g_kyl * lam_k[:, :, None, None]).to(ky.dtype), g_kx.view(h, r, gw, gw).to(kx.dtype),
            (g_kyl * ky_k).sum(dim=(-1, -2)).to(lam.dtype))

