"""NaN and infinities go through every backend exactly as through the torch backend (``impl="stacked"``): a NaN or
an infinity fed into the values, any field parameter or any steering map gives NaN, +inf and -inf at the same places
in the output and in every gradient, and the same finite numbers elsewhere (docs/operator.md, "Non-finite input")."""

import math
import os
import shutil

import pytest
import torch

from ssogvit import core, ops
from ssogvit.layers import STEER_PATHS, SSoGAttention

OTHERS = ["cpu", "einsum"] if shutil.which(os.environ.get("CC", "cc")) else ["einsum"]
POISONS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
GRID = (6, 9)


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN, +inf and -inf at the same entries; the finite entries equal to rounding."""
    for name, mask in (("NaN", torch.isnan), ("+inf", lambda t: t == math.inf), ("-inf", lambda t: t == -math.inf)):
        assert torch.equal(mask(got), mask(want)), f"{what}: {name} at other places ({int(mask(got).sum())} entries " \
                                                   f"against {int(mask(want).sum())})"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-9, atol=1e-9, msg=what)


def _mixer(steer):
    torch.manual_seed(0)
    gates = dict(gate_init=-1.0) if steer else {}  # a fixed mixer refuses a steering option
    m = SSoGAttention(12, 3, num_atoms=3, steer=steer, sigma_min=0.02, **gates).double()
    with torch.no_grad():  # narrow atoms among wide ones: exact zeros in float64 too, which an infinity makes NaN
        m.rho.uniform_(-8.0, 0.0)
        m.mu.uniform_(-2.0, 2.0)
        m.ell.normal_(0.0, 1.0)
        for name, p in m.named_parameters():
            if "_steer" in name:
                p.normal_(0.0, 0.5)
    return m


def _layer_targets(steer):
    names = [n for n, _ in _mixer(steer).named_parameters() if not n.startswith(("v.", "proj."))]
    return ["x"] + names


CASES = [(steer, target) for steer in ((), STEER_PATHS) for target in _layer_targets(steer)]


def _run_layer(steer, target, poison, impl):
    m = _mixer(steer)
    m.impl = impl
    x = torch.randn(2, 1 + GRID[0] * GRID[1], 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t = x if target == "x" else dict(m.named_parameters())[target]
        t.view(-1)[t.numel() // 3] = poison  # one entry
    x.requires_grad_()
    y = m(x, grid=GRID, num_prefix_tokens=1)
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(2))
    params = [p for n, p in m.named_parameters()]
    return [y.detach(), *torch.autograd.grad((y * w).sum(), [x, *params])]


@pytest.mark.parametrize("impl", OTHERS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("steer,target", CASES, ids=[f"{'steered' if s else 'fixed'}-{t}" for s, t in CASES])
def test_the_layer_output_and_gradients_are_nonfinite_where_the_torch_backends_are(steer, target, poison, impl):
    want = _run_layer(steer, target, POISONS[poison], "stacked")
    for i, (g, w) in enumerate(zip(_run_layer(steer, target, POISONS[poison], impl), want)):
        assert_same_nonfinite(g, w, f"{impl}, {target}={poison}, {'output' if i == 0 else f'gradient {i}'}")


def _fixed_operands():
    g = torch.Generator().manual_seed(3)
    h, r = 2, 3
    mu, sigma = torch.randn(h, r, 2, generator=g, dtype=torch.float64), torch.full((h, r, 2), 0.05, dtype=torch.float64)
    tau = torch.tensor(1.0, dtype=torch.float64)
    ky, kx = (core.axis_kernels(n, mu[..., i], sigma[..., i], tau) for i, n in enumerate(GRID))
    lam = torch.softmax(torch.randn(h, r, generator=g, dtype=torch.float64), -1)
    values = torch.randn(2, 1 + GRID[0] * GRID[1], h * 4, generator=g, dtype=torch.float64)
    return [values, ky, kx, lam]


def _steered_operands():
    g = torch.Generator().manual_seed(4)
    b, n, h, r = 2, GRID[0] * GRID[1], 2, 3
    values = torch.randn(b, 1 + n, h * 4, generator=g, dtype=torch.float64)
    mu = torch.randn(b, n, h, r, 2, generator=g, dtype=torch.float64) * 2
    sigma = torch.rand(b, n, h, r, 2, generator=g, dtype=torch.float64) * 0.3 + 0.03
    lam = torch.softmax(torch.randn(b, n, h, r, generator=g, dtype=torch.float64), -1)
    return [values, mu, sigma, lam, torch.tensor(0.9, dtype=torch.float64)]


def _run_op(kind, which, index, poison, impl):
    args = _fixed_operands() if kind == "fixed" else _steered_operands()
    args[which].view(-1)[index % args[which].numel()] = poison
    args = [t.requires_grad_() for t in args]
    if kind == "fixed":
        y = ops.ssog_mix(args[0], GRID, *args[1:], impl=impl)
    else:
        y = ops.ssog_mix_steered(args[0], GRID, *args[1:], impl=impl)
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(5))
    return [y.detach(), *torch.autograd.grad((y * w).sum(), args)]


OP_CASES = [("fixed", 0, 40), ("fixed", 0, 301), ("fixed", 1, 17), ("fixed", 2, 5), ("fixed", 3, 1),
            ("steered", 0, 40), ("steered", 0, 301), ("steered", 1, 77), ("steered", 2, 123), ("steered", 3, 9),
            ("steered", 4, 0)]


@pytest.mark.parametrize("impl", OTHERS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("kind,which,index", OP_CASES, ids=[f"{k}-arg{w}-{i}" for k, w, i in OP_CASES])
def test_the_mixing_functions_are_nonfinite_where_the_torch_backends_are(kind, which, index, poison, impl):
    """The mixing alone (``ops.ssog_mix``: values, ``ky``, ``kx``, ``lam``; ``ops.ssog_mix_steered``: values, ``mu``,
    ``sigma``, ``lam``, ``tau``), one entry poisoned, on a grid whose kernels have exact zeros: an infinite value
    times such a zero is a NaN, times a positive weight an infinity, in every backend at the same places."""
    want = _run_op(kind, which, index, POISONS[poison], "stacked")
    for i, (g, w) in enumerate(zip(_run_op(kind, which, index, POISONS[poison], impl), want)):
        assert_same_nonfinite(g, w, f"{impl}, {kind} argument {which}={poison}, {'output' if i == 0 else f'grad {i}'}")


def test_an_infinite_value_gives_both_infinities_and_nans():
    """The op-level cases above see both kinds of result (an infinity where every weight on it is positive, a NaN
    where one is an exact zero), so they check where each lands, not only that something is non-finite."""
    y = _run_op("fixed", 0, 40, math.inf, "stacked")[0]
    assert torch.isinf(y).any() and torch.isnan(y).any()
    y = _run_op("steered", 0, 40, math.inf, "stacked")[0]
    assert torch.isinf(y).any() and torch.isnan(y).any()
