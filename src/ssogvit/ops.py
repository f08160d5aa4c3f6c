"""Functional core of SSoG: Gaussian axis kernels and the separable mixing they define (docs/operator.md).

Everything here is a function of plain tensors. Shapes use these letters:

    B batch, H heads, R atoms, dh head width, D = H * dh,
    Gh x Gw patch grid, N = Gh * Gw patch tokens in row-major raster order, P prefix tokens.

The N x N mixing matrix is never built here; ``ssogvit.reference`` does that for tests and diagnostics.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "SSOG_IMPLS",
    "field_sigma",
    "field_tau",
    "axis_kernels",
    "token_axis_kernels",
    "ssog_mix",
    "ssog_mix_steered",
    "prefix_pool",
    "check_grid",
    "position_dtype",
    "default_mix_head_chunk",
]

#: Implementations of the fixed separable contraction. ``"auto"`` picks one by problem size.
#: ``"triton"``: the fused kernel of ``ssogvit.kernels`` (CUDA; ``"auto"`` picks it in half precision, and in float32
#: with TF32 on, when Triton imports and the kernel passed its probe on the device).
SSOG_IMPLS = ("auto", "stacked", "loop", "einsum", "triton")


def _grid_side(g: object) -> int:
    if isinstance(g, torch.SymInt):  # traced / exported with a dynamic image size
        return g  # type: ignore[return-value]
    if isinstance(g, bool) or not hasattr(g, "__index__"):
        raise TypeError
    return operator.index(g)  # ints, numpy ints and integer tensors; 4.9 or 4.0 is an error, never truncated


def check_grid(
    num_tokens: int, grid: tuple[int, int], num_prefix_tokens: int | None = None
) -> tuple[int, int, int]:
    """Validate a grid against a token count; returns ``(Gh, Gw, num_prefix_tokens)``.

    Args:
        num_tokens: ``T``, the length of the token sequence.
        grid: ``(Gh, Gw)``, two positive integers (a float, even a whole one, is an error, never truncated).
        num_prefix_tokens: ``P`` when the caller knows it (every model does): then ``T`` must be exactly
            ``P + Gh * Gw``. ``None`` takes ``P = T - Gh * Gw`` (any ``P >= 0``).
    """
    try:
        gh, gw = (_grid_side(g) for g in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (Gh, Gw) of positive ints, got {grid!r}") from None
    if gh < 1 or gw < 1:
        raise ValueError(f"grid must be a pair (Gh, Gw) of positive ints, got {grid!r}")
    prefix = num_tokens - gh * gw
    if num_prefix_tokens is not None:
        if prefix != num_prefix_tokens:
            raise ValueError(
                f"token count {num_tokens} does not fit the grid: expected P + Gh*Gw = {num_prefix_tokens} + "
                f"{gh}*{gw} = {num_prefix_tokens + gh * gw} tokens (P={num_prefix_tokens} prefix tokens, Gh={gh}, "
                f"Gw={gw})"
            )
    elif prefix < 0:
        raise ValueError(
            f"token count {num_tokens} does not fit the grid: expected P + Gh*Gw tokens with Gh={gh}, Gw={gw} "
            f"(Gh*Gw={gh * gw}) and P >= 0 prefix tokens"
        )
    return gh, gw, prefix


def position_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels are built in: at least float32, so that grid positions above 256 (bfloat16) or 2048
    (float16) stay exact integers; float64 stays float64. The tables are cast to the values' dtype afterwards."""
    return torch.promote_types(dtype, torch.float32)


def field_sigma(rho: Tensor, sigma_min: float, eps_sigma: float) -> Tensor:
    """Width ``sigma = sigma_min + softplus(rho) + eps_sigma``, in grid cells."""
    return sigma_min + F.softplus(rho) + eps_sigma


def field_tau(theta: Tensor, tau_min: float) -> Tensor:
    """Temperature ``tau = tau_min + softplus(theta)``."""
    return tau_min + F.softplus(theta)


def functional_only() -> bool:
    """Under ``torch.jit.trace`` or ``torch.export`` (the dynamo ONNX exporter included): the inference shortcuts that
    write into buffers (in-place ops, slice writes into views of a preallocated output) are not taken there, because
    an exported graph need not keep their aliasing (the TorchScript-based ONNX export of SSoG gave logits off by up to
    6 with them; docs/models.md). ``torch.compile`` alone functionalises mutations itself and keeps the fast paths."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def _flush_tiny(k: Tensor) -> Tensor:
    # Softmax tails far below the smallest normal number are denormals; a matmul that meets them runs several times
    # slower on x86 CPUs. Their contribution is below rounding, so they are set to exactly zero (docs/benchmarks.md).
    tiny = torch.finfo(k.dtype).tiny
    if (torch.is_grad_enabled() and k.requires_grad) or functional_only():
        return k.masked_fill(k < tiny, 0.0)
    return k.masked_fill_(k < tiny, 0.0)  # inference: no second table-sized allocation


def _flush_tiny_product(k: Tensor) -> Tensor:
    """``_flush_tiny`` for a fresh product of (non-negative) kernels and mixture weights: lambda < 1 can push a normal
    tail entry below the smallest normal number again. The gradient passes through unchanged (the flushed values are
    below 1e-38, the gradient at them is not), so the result's gradients match the unflushed product's exactly."""
    tiny = torch.finfo(k.dtype).tiny
    if (torch.is_grad_enabled() and k.requires_grad) or functional_only():
        return k - k.masked_fill(k >= tiny, 0.0).detach()
    return k.masked_fill_(k < tiny, 0.0)


def axis_kernels(length: int, mu: Tensor, sigma: Tensor, tau: Tensor) -> Tensor:
    """Row-softmax Gaussian kernels along one grid axis.

    ``K[..., i, j] = softmax_j( -(j - i - mu)^2 / (2 sigma^2 tau) )`` over the ``length`` positions inside the grid.

    Args:
        length: axis length ``L`` (``Gh`` or ``Gw``).
        mu: atom centres along this axis, any shape ``S`` (e.g. ``(H, R)``), in grid cells.
        sigma: widths, shape ``S``.
        tau: temperature, broadcastable to ``S``.

    Returns:
        Kernels of shape ``S + (L, L)`` in ``position_dtype(mu.dtype)``; each row sums to 1.
    """
    dtype = position_dtype(mu.dtype)
    mu, sigma, tau = mu.to(dtype), sigma.to(dtype), tau.to(dtype)
    pos = torch.arange(length, device=mu.device, dtype=dtype)
    delta = pos[None, :] - pos[:, None]  # (L, L): source j minus query i
    scale = 2.0 * sigma.square() * tau  # S
    logits = -(delta - mu[..., None, None]).square() / scale[..., None, None]  # S + (L, L)
    return _flush_tiny(torch.softmax(logits, dim=-1))


def token_axis_kernels(length: int, query: Tensor, mu: Tensor, sigma: Tensor, tau: Tensor) -> Tensor:
    """Per-token kernel rows along one axis (steered SSoG): ``K[..., j] = softmax_j(-(j - query - mu)^2 / (2 s^2 tau))``.

    Args:
        length: axis length ``L``.
        query: the query index along the axis, broadcastable to ``mu``'s shape.
        mu, sigma: per-token geometry, shape ``S``.
        tau: temperature, broadcastable to ``S``.

    Returns:
        Kernel rows of shape ``S + (L,)`` in ``position_dtype(mu.dtype)``.
    """
    dtype = position_dtype(mu.dtype)
    mu, sigma, tau = mu.to(dtype), sigma.to(dtype), torch.as_tensor(tau).to(dtype)
    pos = torch.arange(length, device=mu.device, dtype=dtype)
    offset = (query + mu)[..., None]  # S + (1,)
    neg_inv = (-0.5 / (sigma.square() * tau))[..., None]  # S + (1,)
    if (torch.is_grad_enabled() and (mu.requires_grad or sigma.requires_grad)) or functional_only():
        logits = (pos - offset).square() * neg_inv
    else:  # inference: one table-sized buffer, updated in place
        logits = (pos - offset).square_().mul_(neg_inv)
    return _flush_tiny(torch.softmax(logits, dim=-1))


def prefix_pool(values: Tensor, num_prefix: int) -> Tensor:
    """Mixer output of the prefix tokens: the mean of the patch values, once per prefix token (docs/operator.md).

    Args:
        values: patch values ``(B, N, D)``.
        num_prefix: ``P``.

    Returns:
        ``(B, P, D)``.
    """
    return values.mean(dim=1, keepdim=True).expand(-1, num_prefix, -1)


# ---------------------------------------------------------------------------------------------------------------------
# Fixed SSoG


def ssog_mix(
    values: Tensor,
    grid: tuple[int, int],
    ky: Tensor,
    kx: Tensor,
    lam: Tensor,
    *,
    impl: str = "auto",
    inplace: bool = False,
    head_chunk: int | None = None,
) -> Tensor:
    """Separable fixed-SSoG mixing of all tokens: prefix tokens get the mean patch value, patches

    ``Y_h[iy, ix] = sum_r lam[h, r] sum_{jy, jx} ky[h, r, iy, jy] kx[h, r, ix, jx] V_h[jy, jx]``.

    Args:
        values: values of all tokens ``(B, P + N, D)``, prefix first, patches in raster order (``N = Gh * Gw``).
        grid: ``(Gh, Gw)``.
        ky: y-axis kernels ``(H, R, Gh, Gh)``.
        kx: x-axis kernels ``(H, R, Gw, Gw)``.
        lam: mixture weights ``(H, R)``.
        impl: ``"stacked"`` (atoms stacked inside one matmul per pass and head, lambda folded into the y-kernels,
            a custom autograd function that saves only the values and recomputes the rest: the default),
            ``"loop"`` (one atom at a time, head-major layout), ``"einsum"`` (plain, the benchmarks' baseline),
            ``"triton"`` (fused kernel, CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (``"triton"`` on
            CUDA tensors in float16 or bfloat16, and in float32 where TF32 is on, when Triton imports, the kernel
            passed its probe on the device and its tiles fit; ``"stacked"`` otherwise).
        inplace: let the mixing overwrite ``values`` (inference only: an error if autograd would need them).
            ``"stacked"`` then writes its result into ``values``' buffer, one activation-sized buffer less: each
            head's values are read for the last time before its result is written. The other implementations
            ignore it.
        head_chunk: heads mixed together by ``"stacked"`` (one batched matmul per pass for the chunk instead of one
            per head). ``None`` picks by size: chunks of ``H // (R + 2)`` heads (their temporaries stay within one
            activation) where ``B * N`` is small enough that per-head matmuls are too small to use both cores, one
            head at a time otherwise.

    Returns:
        Mixed values ``(B, P + N, D)``.
    """
    gh, gw = grid
    p = values.shape[1] - gh * gw
    grad_needed = torch.is_grad_enabled() and any(t.requires_grad for t in (values, ky, kx, lam))
    if inplace and grad_needed:
        raise ValueError("ssog_mix(inplace=True) overwrites the values, which autograd needs: use it without grad")
    if inplace and functional_only():
        raise ValueError("ssog_mix(inplace=True) cannot be traced or exported: the graph would lose the aliasing")
    if impl in ("auto", "stacked") and functional_only():
        impl = "einsum"  # no writes into a preallocated output (see functional_only)
    if impl == "triton" or (impl == "auto" and values.is_cuda and _triton_ready(values, grid, lam.shape[1])):
        from ssogvit.kernels import ssog_mix_triton  # imports Triton on first use only

        return ssog_mix_triton(values, grid, ky, kx, lam)
    if impl in ("auto", "stacked"):
        h, r = lam.shape
        ky_fold = _flush_tiny_product(ky * lam[:, :, None, None]).permute(0, 2, 3, 1).reshape(h, gh, gh * r)
        kx_stack = kx.reshape(h, r * gw, gw)  # rows (atom, ix)
        if grad_needed:
            return _StackedMix.apply(values, ky_fold, kx_stack, gh, gw)
        chunk = head_chunk or default_mix_head_chunk(values.shape[0] * gh * gw, h, r)
        return _stacked_forward(values, ky_fold, kx_stack, gh, gw, values if inplace else None, chunk)
    if impl == "loop":
        mixed = _mix_loop(values[:, p:], grid, ky, kx, lam)
    elif impl == "einsum":
        mixed = _mix_einsum(values[:, p:], grid, ky, kx, lam)
    else:
        raise ValueError(f"unknown SSoG implementation {impl!r}; expected one of {SSOG_IMPLS}")
    return torch.cat([prefix_pool(values[:, p:], p), mixed], dim=1) if p else mixed


#: Below this many patch tokens in a batch (``B * N``), ``"stacked"`` mixes heads in chunks: its per-head matmuls
#: are then too small to keep two cores busy (measured on the 2-core CPU of docs/benchmarks.md, ViT-B width, mixing
#: alone: chunks of 2 heads take 0.70x the per-head time at 224 batch 1, 0.79x at 224 batch 2, 0.80x at 384 batch 1;
#: at 224 batch 4 and 384 batch 2 no gain; at 512 batch 1 two measurements disagreed, so the rule stops below it).
SMALL_MIX_TOKENS = 640


def default_mix_head_chunk(batch_tokens: int, heads: int, atoms: int) -> int:
    """Heads per chunk for the fixed mixing's forward (see ``ssog_mix``'s ``head_chunk``)."""
    if batch_tokens > SMALL_MIX_TOKENS:
        return 1
    return max(1, heads // (atoms + 2))  # a chunk's temporaries: (atoms + 2) * chunk / heads activations


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
    patches = values[:, p:]
    vp = patches.view(b, gh, gw, h, dh)
    if out is None:
        out = values.new_empty(b, t, d)
    if p:  # before any patch row is overwritten
        out[:, :p] = patches.mean(dim=1, keepdim=True)
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


def _triton_ready(values: Tensor, grid: tuple[int, int], atoms: int) -> bool:
    from ssogvit.kernels.triton_ssog import auto_picks_triton

    return auto_picks_triton(values, grid, atoms)  # dtype rule, Triton imports, probe passed, tiles fit the device


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
        r = kx_stack.shape[1] // gw
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
            g_y = gp[:, :, :, hi].reshape(b, gh, gw * dh)  # dL/dY, (B, Gh, Gw*dh)
            v_h = vp[:, :, :, hi].reshape(b * gh, gw, dh)
            if need_ky:
                u = torch.matmul(kx_stack[hi], v_h).view(b, gh * r, gw * dh)  # recomputed x-pass
                g_ky[hi] = torch.matmul(g_y, u.transpose(1, 2)).sum(0)
                del u
            g_u = torch.matmul(ky_fold[hi].t(), g_y).view(b * gh, r * gw, dh)  # dL/dU
            if need_kx:
                g_kx[hi] = torch.matmul(g_u.transpose(0, 1).reshape(r * gw, b * gh * dh), v_h.transpose(1, 2).reshape(b * gh * dh, gw))
            if need_v:
                gvp[:, :, :, hi] = torch.matmul(kx_stack[hi].t(), g_u).view(b, gh, gw, dh)
        if need_v and p:
            gvp += grad[:, :p].sum(dim=1).view(b, 1, 1, h, dh) / (gh * gw)
        return g_values, g_ky, g_kx, None, None


# ---------------------------------------------------------------------------------------------------------------------
# Content-steered SSoG


def ssog_mix_steered(
    values: Tensor,
    grid: tuple[int, int],
    mu: Tensor,
    sigma: Tensor,
    lam: Tensor,
    tau: Tensor,
    *,
    head_chunk: int | None = None,
    inplace: bool = False,
) -> Tensor:
    """Separable mixing with per-token geometry (docs/operator.md).

    Column pass ``U_r[iy, k] = sum_jy K^y(g_(iy,k))[r, iy, jy] V[jy, k]`` (steered by the token at ``(iy, k)``),
    row pass ``Y[iy, ix] = sum_r lam_(iy,ix)[r] sum_k K^x(g_(iy,ix))[r, ix, k] U_r[iy, k]`` (steered by the query).

    Args:
        values: values of all tokens ``(B, P + N, D)``; prefix tokens get the mean patch value.
        grid: ``(Gh, Gw)``.
        mu: per-token centres ``(B, N, H, R, 2)``, axis order ``(y, x)``.
        sigma: per-token widths ``(B, N, H, R, 2)``.
        lam: per-token mixture weights ``(B, N, H, R)``.
        tau: temperature, a scalar tensor or ``(H,)``.
        head_chunk: heads processed together; bounds the per-token kernel tables to
            ``B * N * head_chunk * R * (Gh + Gw)`` entries. ``None`` = all heads at once.
        inplace: write the result over ``values`` and return it (inference only: an error if autograd would need
            ``values``); each chunk's values are read for the last time before its result is written.

    Returns:
        Mixed values ``(B, P + N, D)``.
    """
    b, t, d = values.shape
    gh, gw = grid
    p = t - gh * gw
    h, r = mu.shape[2], mu.shape[3]
    dh = d // h
    tau = tau.reshape(-1)
    tau = tau.expand(h) if tau.numel() == 1 else tau
    # query indices, laid out as the kernel tables below: y rows in (b, k, h, iy, r), x rows in (b, iy, h, ix, r)
    pos_dtype = position_dtype(mu.dtype)
    iy = torch.arange(gh, device=values.device, dtype=pos_dtype).view(1, 1, 1, gh, 1)
    ix = torch.arange(gw, device=values.device, dtype=pos_dtype).view(1, 1, 1, gw, 1)
    v = values[:, p:].view(b, gh, gw, h, dh)
    mu = mu.reshape(b, gh, gw, h, r, 2)
    sigma = sigma.reshape(b, gh, gw, h, r, 2)
    lam = lam.reshape(b, gh, gw, h, r)
    chunk = h if head_chunk is None else max(1, int(head_chunk))
    if inplace and torch.is_grad_enabled() and values.requires_grad:
        raise ValueError(
            "ssog_mix_steered(inplace=True) overwrites the values, which autograd needs: use it without grad"
        )
    functional = functional_only()  # then each chunk's result is kept and concatenated, nothing written in place
    if inplace and functional:
        raise ValueError(
            "ssog_mix_steered(inplace=True) cannot be traced or exported: the graph would lose the aliasing"
        )
    out_all = values if inplace else None if functional else values.new_empty(b, t, d)
    if p and not functional:  # before any patch row is overwritten
        out_all[:, :p] = values[:, p:].mean(dim=1, keepdim=True)
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
        ky = token_axis_kernels(
            gh, iy, mu[:, :, :, hs, :, 0].permute(col).contiguous(), sigma[:, :, :, hs, :, 0].permute(col), t
        ).to(values.dtype)  # (B, Gw, c, Gh, R, Gh)
        # column pass, batched over (b, k, h): ((iy, r), jy) @ (jy, d)
        v_b = v[:, :, :, hs].permute(0, 2, 3, 1, 4).reshape(b * gw * c, gh, dh)
        u = torch.bmm(ky.view(b * gw * c, gh * r, gh), v_b).view(b, gw, c, gh, r, dh)  # U[b, k, h, iy, r, d]
        del ky, v_b
        row = (0, 1, 3, 2, 4)  # (b, iy, ix, h, r) -> (b, iy, h, ix, r): the query steers its own row and mixture
        kx = token_axis_kernels(
            gw, ix, mu[:, :, :, hs, :, 1].permute(row).contiguous(), sigma[:, :, :, hs, :, 1].permute(row), t
        )  # (B, Gh, c, Gw, R, Gw)
        weights = lam[:, :, :, hs].permute(row)[..., None]
        kx = kx.mul_(weights) if inference else kx * weights
        # flushed in place in training too: this table is internal, and the gradient lost at flushed entries reaches
        # mu, sigma and lambda multiplied by a kernel value below tiny / lambda (see _flush_tiny_product)
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


def default_head_chunk(grid: tuple[int, int], heads: int, atoms: int, dim: int) -> int:
    """Heads per steered chunk so that one chunk's temporaries stay within about a third of the activation.

    Per token and head a chunk holds its kernel tables (``R * (Gh + Gw)`` entries) and, while the column pass's
    result is re-laid out for the row pass, two copies of it (``2 * R * dh``). At ViT widths that is one head at a time.
    """
    gh, gw = grid
    per_head = atoms * (gh + gw) + 2 * atoms * (dim // heads)
    return max(1, min(heads, dim // (3 * per_head)))
