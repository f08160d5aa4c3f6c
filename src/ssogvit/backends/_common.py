"""What both backends share: the trace/export test, the denormal flush, the prefix term and the kernel gradients.

docs/operator.md states the maths ("Prefix tokens", "Denormals", "Backward"); shapes use its letters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "add_prefix_grad",
    "flush_tiny",
    "flush_tiny_product",
    "functional_only",
    "gaussian_rows_grad",
    "grid_offsets",
    "head_grads",
    "tf32_enabled",
    "prefix_pool",
    "write_prefix_pool",
]


def functional_only() -> bool:
    """Under ``torch.jit.trace`` or ``torch.export`` (the dynamo ONNX exporter included): the inference shortcuts that
    write into buffers (in-place ops, slice writes into views of a preallocated output) are not taken there, because
    an exported graph need not keep their aliasing (the TorchScript-based ONNX export of SSoG gave logits off by up to
    6 with them; docs/models.md). ``torch.compile`` alone functionalises mutations itself and keeps the fast paths."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def flush_tiny(k: Tensor) -> Tensor:
    """Kernel entries below the dtype's smallest normal number set to exactly zero (docs/operator.md, "Denormals");
    in place in inference (no second table-sized allocation)."""
    tiny = torch.finfo(k.dtype).tiny
    if functional_only():  # the same rule in an op every exporter knows (ONNX has no threshold)
        return k.masked_fill(k <= tiny, 0.0)
    if torch.is_grad_enabled() and k.requires_grad:
        return F.threshold(k, tiny, 0.0)  # zero where k <= tiny, and no gradient there
    return F.threshold_(k, tiny, 0.0)  # one pass, in place


def flush_tiny_product(k: Tensor) -> Tensor:
    """``flush_tiny`` for a fresh product of (non-negative) kernels and mixture weights: lambda < 1 can push a normal
    tail entry below the smallest normal number again. The gradient passes through unchanged (the flushed values are
    below 1e-38, the gradient at them is not), so the result's gradients match the unflushed product's exactly."""
    tiny = torch.finfo(k.dtype).tiny
    if (torch.is_grad_enabled() and k.requires_grad) or functional_only():
        return k - k.masked_fill(k > tiny, 0.0).detach()
    return F.threshold_(k, tiny, 0.0)


def grid_offsets(length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``delta[i, j] = j - i`` over ``length`` grid positions ``(L, L)``: the exact integer offsets of source ``j`` from
    query ``i`` that every axis kernel is evaluated at (docs/operator.md, "Axis kernels")."""
    pos = torch.arange(length, device=device, dtype=dtype)
    return pos[None, :] - pos[:, None]


def prefix_pool(patches: Tensor, num_prefix: int) -> Tensor:
    """Mixer output of the prefix tokens: the mean of the patch values ``(B, N, D)``, once per prefix token, as a
    ``(B, P, D)`` view (docs/operator.md, "Prefix tokens")."""
    return patches.mean(dim=1, keepdim=True).expand(-1, num_prefix, -1)


def write_prefix_pool(out: Tensor, values: Tensor, num_prefix: int) -> None:
    """``out[:, :P] = prefix_pool(values[:, P:], P)``: the prefix rows of a preallocated output ``(B, P + N, D)``,
    written before any patch row of ``out`` (which may be ``values`` itself) is overwritten."""
    if num_prefix:
        out[:, :num_prefix] = prefix_pool(values[:, num_prefix:], num_prefix)


def add_prefix_grad(g_values: Tensor, grad: Tensor, num_prefix: int) -> None:
    """Backward of ``prefix_pool``, added into the patch rows of ``g_values (B, P + N, D)``: every patch receives the
    sum of the prefix rows of ``grad (B, P + N, D)`` divided by ``N``. Prefix values get no gradient from it."""
    if num_prefix:
        n = g_values.shape[1] - num_prefix
        g_values[:, num_prefix:] += grad[:, :num_prefix].sum(dim=1, keepdim=True) / n


def head_grads(
    v_h: Tensor,
    g_y: Tensor,
    kx_h: Tensor,
    ky_fold_h: Tensor,
    *,
    need_ky: bool,
    need_kx: bool,
    need_v: bool,
    acc_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of one head of the fixed mixing ``Y = Kyl_fold U``, ``U = Kx_stack V`` (docs/operator.md, "Backward"),
    the x-pass ``U`` recomputed rather than saved.

    Args:
        v_h: the head's patch values ``(B*Gh, Gw, dh)``, rows ``(b, jy)``.
        g_y: ``dL/dY`` ``(B, Gh, Gw*dh)``.
        kx_h: x-kernels of all atoms stacked ``(R*Gw, Gw)``, rows ``(r, ix)``.
        ky_fold_h: y-kernels with lambda folded in ``(Gh, Gh*R)``, columns ``(jy, r)``.
        need_ky, need_kx, need_v: which gradients to compute.
        acc_dtype: dtype of the batch sum of the y-kernels' gradient (``None``: the inputs').

    Returns:
        ``(dL/dKyl_fold (Gh, Gh*R), dL/dKx_stack (R*Gw, Gw), dL/dV (B*Gh, Gw, dh))``, ``None`` where not needed.
    """
    b, gh, gwdh = g_y.shape
    rgw, gw = kx_h.shape
    dh = v_h.shape[-1]
    g_ky = g_kx = g_v = None
    if need_ky:
        u = torch.matmul(kx_h, v_h).view(b, -1, gwdh)  # recomputed x-pass (B, Gh*R, Gw*dh), rows (jy, r)
        g_ky = torch.matmul(g_y, u.transpose(1, 2)).sum(0, dtype=acc_dtype)
        del u
    if need_kx or need_v:
        g_u = torch.matmul(ky_fold_h.t(), g_y).view(b * gh, rgw, dh)  # dL/dU, layout (b, jy, r, ix, d)
        if need_kx:
            g_kx = torch.matmul(g_u.transpose(0, 1).reshape(rgw, b * gh * dh), v_h.transpose(1, 2).reshape(-1, gw))
        if need_v:
            g_v = torch.matmul(kx_h.t(), g_u)
    return g_ky, g_kx, g_v


def gaussian_rows_grad(rows: Tensor, d: Tensor, scale: Tensor, g_rows: Tensor, *, inplace: bool = False
                       ) -> tuple[Tensor, Tensor]:
    """Backward of ``rows = softmax_j(-(d_j s)^2)`` (``ssogvit.ops.gaussian_rows``, ``d = delta - mu``).

    With ``dL/dl_j = K_j (g_j - sum_i K_i g_i)`` (softmax; flushed entries are zero in ``rows`` and pass nothing) and
    ``l_j = -d_j^2 s^2``: ``dL/dmu = 2 s^2 sum_j dL/dl_j d_j`` and ``dL/ds = -2 s sum_j dL/dl_j d_j^2``.

    Args:
        rows, d, g_rows: the rows, ``delta - mu`` and ``dL/drows``, broadcast to one shape.
        scale: ``s`` with a trailing axis of size 1.
        inplace: overwrite ``g_rows`` on the way (one table less; not when a graph is being built).

    Returns:
        ``(dL/dmu, dL/ds)`` per row, with a trailing axis of size 1 (reduce them to ``mu``'s and ``s``'s shapes).
    """
    dot = (rows * g_rows).sum(-1, keepdim=True)
    if inplace:
        t = g_rows.sub_(dot).mul_(rows).mul_(d)  # dL/dl_j d_j
        g_mu = t.sum(-1, keepdim=True)
        g_s = t.mul_(d).sum(-1, keepdim=True)
    else:
        t = rows * (g_rows - dot) * d
        g_mu = t.sum(-1, keepdim=True)
        g_s = (t * d).sum(-1, keepdim=True)
    return 2.0 * scale.square() * g_mu, -2.0 * scale * g_s


def tf32_enabled() -> bool:
    """Whether torch lets float32 CUDA matmuls use TF32: the newer ``fp32_precision`` settings first (the matmul one,
    then the global one), the legacy ``allow_tf32`` flag only when both say ``"none"`` (reading the legacy flag
    raises once a user has set the new one)."""
    for setting in (
        getattr(torch.backends.cuda.matmul, "fp32_precision", "none"),
        getattr(torch.backends, "fp32_precision", "none"),
    ):
        if setting != "none":
            return setting == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        return False
