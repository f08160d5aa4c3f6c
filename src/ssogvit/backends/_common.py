"""What the backends share: the prefix rows, the per-head gradients of the fixed mixing, the TF32 setting, a backward
that builds a graph.

docs/operator.md states the maths ("Prefix tokens", "Backward"); shapes use the letters of ``ssogvit.core``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssogvit.core import prefix_pool

__all__ = ["add_prefix_grad", "graph_grads", "head_grads", "tf32_enabled", "write_prefix_pool"]


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
    need_ky: bool = True,
    need_kx: bool = True,
    need_v: bool = True,
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


def graph_grads(fn, inputs: tuple[Tensor, ...], grad: Tensor) -> list[Tensor | None]:
    """The gradients of ``fn(*inputs)`` for ``grad``, as a graph (a backward under ``create_graph=True``, which
    autograd can differentiate again; the saved inputs carry the outer graph)."""
    with torch.enable_grad():
        live = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad(fn(*inputs), live, grad, create_graph=True, allow_unused=True))
    return [next(found) if t.requires_grad else None for t in inputs]
