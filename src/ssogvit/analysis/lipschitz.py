"""Lipschitz constants of SSoG mixers: the bound of Proposition 1 and an empirical estimate (docs/analysis.md).

A fixed-SSoG mixer is the affine map `x -> W_O (M_h (x W_V)_h)_h`, where per head `M_h` is the dense
`(P + N) x (P + N)` token-mixing matrix: patch rows are `A_h = sum_r lambda_r kron(K^y_r, K^x_r)`, prefix rows the
mean over patches. `M_h` is entrywise non-negative, so `||M_h||_2 <= sqrt(||M_h||_1 ||M_h||_inf)` (largest column
sum times largest row sum), and the mixer's Lipschitz constant is at most
`max_h sqrt(||M_h||_1 ||M_h||_inf) * ||W_O||_2 * ||W_V||_2`.

The column sums never need `M_h`: column `(jy, jx)` of `A_h` sums to `sum_r lambda_r cy_r[jy] cx_r[jx]` with
`cy_r`, `cx_r` the column sums of the axis kernels, and the prefix rows add `P / N` to every patch column. (With
prefix tokens the bound is therefore `sqrt(max col + P/N)`, not `sqrt(max col)`: the pooled prefix outputs are extra
outputs, so they can raise the norm even though the mean is a contraction.)

The empirical estimate is power iteration on the mixer's Jacobian (`J^T J` through a JVP and a VJP, by autograd).
Every iterate `||J v|| / ||v||` is a lower bound on `||J||_2`, so the estimate can only approach the bound from below.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ssogvit import ops, results
from ssogvit.layers import is_ssog

from ._common import is_steered, mixer_grid, mixer_rows

#: Largest centre the bound accepts: ``(j - i - mu)^2`` in float64 rounds by about ``eps * mu^2``, which stays far
#: below the logits' spacing ``~ mu / (sigma^2 tau)`` wherever the softmax is not saturated (up to ~1e-5 at 1e9).
_MAX_CENTRE = 1e9


@torch.no_grad()
def head_norm_bounds(mixer: nn.Module, grid: tuple[int, int], num_prefix_tokens: int = 0) -> Tensor:
    """Per-head `sqrt(max column sum * max row sum)` of a fixed-SSoG mixer's token-mixing matrix, without forming it.

    Returns:
        `(H,)` float64.
    """
    gh, gw = grid
    n = gh * gw
    mu, sigma, tau = mixer.mu.detach().double(), mixer.sigma().detach().double(), mixer.tau().detach().double()
    if not mu.abs().max() <= _MAX_CENTRE:  # NaN included
        raise ValueError(
            f"a centre of {mu.abs().max().item():.3g} grid cells is beyond {_MAX_CENTRE:.0e}, where the axis kernels "
            f"(docs/operator.md, \"Axis kernels\") lose their accuracy in float64; the bound is not computed"
        )
    tau = tau[:, None] if tau.ndim else tau  # broadcastable to (H, R)
    lam = mixer.mixture().detach().double()  # (H, R)
    ky = ops.axis_kernels(gh, mu[..., 0], sigma[..., 0], tau)  # (H, R, Gh, Gh), float64 (docs/operator.md)
    kx = ops.axis_kernels(gw, mu[..., 1], sigma[..., 1], tau)  # (H, R, Gw, Gw)
    col = torch.einsum("hr,hry,hrx->hyx", lam, ky.sum(-2), kx.sum(-2)).flatten(1)  # (H, N) column sums of A_h
    row = torch.einsum("hr,hry,hrx->hyx", lam, ky.sum(-1), kx.sum(-1)).flatten(1)  # (H, N) row sums of A_h (= 1)
    max_col = (col + num_prefix_tokens / n).amax(-1)  # prefix rows put 1/N on every patch column
    max_row = row.amax(-1)
    if num_prefix_tokens:
        max_row = max_row.clamp(min=1.0)  # prefix rows: the mean, summing to 1
    return (max_col * max_row).sqrt()


def _spectral_norm(linear: nn.Linear) -> float:
    return torch.linalg.matrix_norm(linear.weight.detach().double(), ord=2).item()


@torch.no_grad()
def lipschitz_bound(mixer: nn.Module, grid: tuple[int, int], num_prefix_tokens: int = 0) -> float:
    """Proposition 1: `max_h sqrt(||M_h||_1 ||M_h||_inf) * ||W_O||_2 * ||W_V||_2` for a fixed-SSoG mixer.

    Args:
        mixer: an `SSoGAttention` without steering.
        grid: `(Gh, Gw)`.
        num_prefix_tokens: prefix tokens in front of the patches (they add `P / N` to every column sum).
    """
    if is_steered(mixer):
        raise ValueError("Proposition 1 holds for fixed SSoG; for a steered mixer use local_lipschitz_growth")
    heads = head_norm_bounds(mixer, grid, num_prefix_tokens).max().item()
    return heads * _spectral_norm(mixer.proj) * _spectral_norm(mixer.v)


def jacobian_spectral_norm(
    fn: Callable[[Tensor], Tensor], x: Tensor, *, iters: int = 30, rtol: float = 1e-6, generator=None
) -> float:
    """Largest singular value of the Jacobian of `fn` at `x`, by power iteration on `J^T J` (JVP then VJP).

    Returns the largest `||J v|| / ||v||` seen, a lower bound on `||J||_2` that converges to it.
    """
    x = x.detach()
    v = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator)
    v = v / v.norm()
    jvp, vjp = _jvp_vjp(fn, x)
    best = 0.0
    for _ in range(iters):
        jv = jvp(v)
        gain = jv.norm().item()
        jtjv = vjp(jv)
        size = jtjv.norm()
        if gain == 0.0 or size == 0:
            break
        v = jtjv / size
        converged = gain <= best * (1 + rtol)
        best = max(best, gain)
        if converged:
            break
    return best


def _jvp_vjp(fn: Callable[[Tensor], Tensor], x: Tensor):
    """`(v -> J v, u -> J^T u)` at `x`. One graph, reused: `J^T u` by backward, `J v` by differentiating
    `J^T u` in `u` (double backward), which on CPU is several times faster than forward-mode transforms here."""
    xr = x.clone().requires_grad_(True)
    with torch.enable_grad():
        y = fn(xr)
        u0 = torch.zeros_like(y, requires_grad=True)
        (g,) = torch.autograd.grad(y, xr, u0, create_graph=True)  # J^T u0, linear in u0

    def jvp_fn(v: Tensor) -> Tensor:
        return torch.autograd.grad(g, u0, v, retain_graph=True)[0]

    def vjp_fn(u: Tensor) -> Tensor:
        return torch.autograd.grad(y, xr, u, retain_graph=True)[0]

    return jvp_fn, vjp_fn


def _as_fn(mixer: nn.Module, grid: tuple[int, int]) -> Callable[[Tensor], Tensor]:
    return lambda x: mixer(x, grid=grid, num_prefix_tokens=x.shape[1] - grid[0] * grid[1])


def _differentiable_copy(mixer: nn.Module) -> nn.Module:
    """A float64 copy in eval mode whose fixed-field contraction is the plain autograd one (`impl="einsum"`): the
    fast paths may use custom backward passes that cannot be differentiated twice. Same operator (the fast paths are
    tested against it)."""
    m = copy.deepcopy(mixer).double().eval()
    if getattr(m, "impl", None) not in (None, "einsum"):
        m.impl = "einsum"
    return m


def lipschitz_estimate(
    mixer: nn.Module, grid: tuple[int, int], num_prefix_tokens: int = 0, *, x: Tensor | None = None,
    iters: int = 30, seed: int = 0,
) -> float:
    """Empirical Lipschitz constant of a mixer: power iteration on its Jacobian at `x` (random if omitted), float64.

    For fixed SSoG the mixer is affine, so this is its global constant; for a steered or dense mixer, the local one.
    """
    mixer64 = _differentiable_copy(mixer)
    gen = torch.Generator().manual_seed(seed)
    if x is None:
        dim = mixer64.v.in_features
        x = torch.randn(1, num_prefix_tokens + grid[0] * grid[1], dim, dtype=torch.float64, generator=gen)
    return jacobian_spectral_norm(_as_fn(mixer64, grid), x.double(), iters=iters, generator=gen)


def _frozen_bound(attn: Tensor, mixer: nn.Module) -> float:
    """`max_h sqrt(max col sum * max row sum) ||W_O|| ||W_V||` of a materialised map `(1, H, T, T)`."""
    a = attn[0].double()
    per_head = (a.sum(-2).amax(-1) * a.sum(-1).amax(-1)).sqrt()
    return per_head.max().item() * _spectral_norm(mixer.proj) * _spectral_norm(mixer.v)


def local_lipschitz_growth(
    mixer: nn.Module, grid: tuple[int, int], num_prefix_tokens: int = 0, *, radii: Sequence[float] = (),
    samples: int = 2, iters: int = 15, seed: int = 0,
) -> list[dict]:
    """Local Lipschitz constant of a (steered) mixer on balls of growing radius.

    For each radius `r`, `samples` inputs are drawn with every token of Euclidean norm `r` (the sphere bounding the
    ball, where the steered term is largest), and the Jacobian's spectral norm is estimated at each. A steered
    mixer's geometry depends on its input, so its Jacobian gains a term proportional to the values and grows with
    `r`; fixed SSoG stays at its Proposition-1 level. Also reported: the Proposition-1 bound of the frozen field at
    those inputs (the geometry held at its steered value), the part of the Jacobian that steering does not add.

    Returns:
        One dict per radius: `radius`, `local_max`, `local_mean`, `frozen_bound_max`.
    """
    mixer64 = _differentiable_copy(mixer)
    fn = _as_fn(mixer64, grid)
    gen = torch.Generator().manual_seed(seed)
    dim = mixer64.v.in_features
    tokens = num_prefix_tokens + grid[0] * grid[1]
    rows = []
    for r in radii:
        local, frozen = [], []
        for _ in range(samples):
            x = torch.randn(1, tokens, dim, dtype=torch.float64, generator=gen)
            x = r * x / x.norm(dim=-1, keepdim=True)
            local.append(jacobian_spectral_norm(fn, x, iters=iters, rtol=1e-4, generator=gen))
            with torch.no_grad():
                attn = mixer64.attention_matrix(x, grid, num_prefix_tokens=num_prefix_tokens)
            frozen.append(_frozen_bound(attn, mixer64))
        rows.append({"radius": float(r), "local_max": max(local), "local_mean": sum(local) / len(local),
                     "frozen_bound_max": max(frozen)})
    return rows


#: the most power-iteration steps of a steered mixer's local estimate (each step differentiates the mixer again)
STEERED_ITERS = 15


def lipschitz_report(
    model: nn.Module, *, radii: Sequence[float] | None = None, iters: int = 30, seed: int = 0,
    samples: int = 2, max_steered: int | None = 3,
) -> dict:
    """Bound and estimate for every fixed-SSoG mixer of `model`; growth on balls for steered ones.

    `radii` default to `(0.5, 1, 2, 4) * sqrt(D)`: after LayerNorm a token's norm is about `sqrt(D)`. The growth of
    steered mixers (a power iteration per radius and sample) is measured on at most `max_steered` of them, first,
    middle and last (`None`: all).
    """
    grid = mixer_grid(model)
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    out = {"grid": list(grid), "num_prefix_tokens": prefix, "fixed": [], "steered": []}
    rows = [(name, m) for name, m in mixer_rows(model) if is_ssog(m)]
    steered = [i for i, (_, m) in enumerate(rows) if is_steered(m)]
    if max_steered is not None and len(steered) > max_steered:
        keep = {steered[round(k * (len(steered) - 1) / max(1, max_steered - 1))] for k in range(max_steered)}
        steered = sorted(keep)
    for i, (name, mixer) in enumerate(rows):
        if is_steered(mixer):
            if i not in steered:
                continue
            scale = math.sqrt(mixer.v.in_features)
            rs = list(radii) if radii is not None else [f * scale for f in (0.5, 1.0, 2.0, 4.0)]
            steps = min(iters, STEERED_ITERS)
            out["steered"].append({"layer": name, "iters": steps, "growth": local_lipschitz_growth(
                mixer, grid, prefix, radii=rs, samples=samples, iters=steps, seed=seed)})
        else:
            bound = lipschitz_bound(mixer, grid, prefix)
            est = lipschitz_estimate(mixer, grid, prefix, iters=iters, seed=seed)
            heads = head_norm_bounds(mixer, grid, prefix).tolist()
            out["fixed"].append({"layer": name, "bound": bound, "estimate": est, "ratio": est / bound,
                                 "head_factor": heads, "norm_proj": _spectral_norm(mixer.proj),
                                 "norm_v": _spectral_norm(mixer.v)})
    return out


_MARKERS = ("o", "s", "^", "D", "v", "P")


def _log_axis(axis) -> None:
    """Make `axis` logarithmic with labelled ticks at 1, 2, 3, 5 times each power of ten inside its range (more
    inside a single decade, thinned to 1, 2, 5 when there are many), written as plain numbers: a range inside one
    decade would otherwise carry one or two labels. Call it after plotting (it reads the axis's range)."""
    import math

    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, StrMethodFormatter

    ax = axis.axes
    ax.set_xscale("log") if axis.axis_name == "x" else ax.set_yscale("log")
    low, high = ax.get_xlim() if axis.axis_name == "x" else ax.get_ylim()
    decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
    ticks = [m * 10.0 ** k for k in decades for m in (1, 2, 3, 5) if low <= m * 10.0 ** k <= high]
    if len(ticks) < 4:  # a range inside one decade: label 4, 6, 8 too
        ticks = [m * 10.0 ** k for k in decades for m in (1, 1.5, 2, 3, 4, 5, 6, 8) if low <= m * 10.0 ** k <= high]
    if len(ticks) > 8:
        ticks = [t for t in ticks if round(t / 10 ** math.floor(math.log10(t)), 6) in (1, 2, 5)]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def plot_lipschitz(reports: dict[str, dict], path) -> object:
    """Bound and estimate per fixed-SSoG mixer (left); local constant against the ball radius for steered mixers."""
    has_fixed = any(r["fixed"] for r in reports.values())
    has_steered = any(r["steered"] for r in reports.values())
    if not (has_fixed or has_steered):
        return None
    plt = results.pyplot()
    panels = int(has_fixed) + int(has_steered)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 2.6 * has_steered + 2.2 * has_fixed, 3.6),
                             squeeze=False)
    axes = list(axes[0])
    if has_fixed:
        ax = axes.pop(0)
        for k, (label, rep) in enumerate(reports.items()):
            if not rep["fixed"]:
                continue
            xs = range(len(rep["fixed"]))
            ax.plot(xs, [r["bound"] for r in rep["fixed"]], "s-", color=f"C{k}", label=f"{label}: bound (Prop. 1)")
            ax.plot(xs, [r["estimate"] for r in rep["fixed"]], "o:", color=f"C{k}", label=f"{label}: power iteration")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _log_axis(ax.yaxis)
        ax.set_xlabel("fixed-SSoG mixer")
        ax.set_ylabel("Lipschitz constant")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the panel: hides no point
        ax.set_title("fixed SSoG: the estimate stays below the bound", fontsize=9)
    if has_steered:
        ax = axes.pop(0)
        for k, (label, rep) in enumerate(reports.items()):
            for i, row in enumerate(rep["steered"]):
                g = row["growth"]
                style = dict(color=f"C{k}", alpha=0.35 + 0.65 * (i + 1) / len(rep["steered"]))
                marker = _MARKERS[i % len(_MARKERS)]
                ax.plot([r["radius"] for r in g], [r["local_max"] for r in g], f"{marker}-", ms=4, **style,
                        label=f"{label}: local ||J||, {row['layer']}")
                ax.plot([r["radius"] for r in g], [r["frozen_bound_max"] for r in g], f"{marker}:", ms=3, **style,
                        label=f"{label}: frozen-geometry bound, {row['layer']}")
        _log_axis(ax.xaxis)
        _log_axis(ax.yaxis)
        ax.set_xlabel("token norm r (ball radius)")
        ax.set_ylabel("largest ||J(x)||₂ found, ||x_t|| = r")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the panel: hides no line
        ax.set_title("steered SSoG: local constant vs input norm (dotted: frozen-geometry bound)", fontsize=8)
    fig.tight_layout()
    return results.save_figure(fig, path)
