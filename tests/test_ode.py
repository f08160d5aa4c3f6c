"""``ssogvit.models.ode``: the family's own solver table (``STEPS``) against ``torchdiffeq.odeint`` with the method of
the same name, forward and gradient, to rounding (docs/models.md, the ODE family)."""

from __future__ import annotations

import pytest
import torch
from torchdiffeq import odeint

from ssogvit.models.ode import STEPPED_SOLVERS, STEPS, ODEViT, _Field


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny float64 problems on a shared machine
    yield
    torch.set_num_threads(threads)


def test_the_table_is_the_stepped_solvers():
    assert tuple(STEPS) == STEPPED_SOLVERS == ("euler", "midpoint", "heun2", "heun3", "rk4")


@pytest.mark.parametrize("solver", STEPPED_SOLVERS)
def test_each_step_is_torchdiffeqs_method_to_rounding(solver):
    """The model's stepped solve over the grid equals ``torchdiffeq.odeint(..., method=solver)`` on the same grid:
    the tokens, and the gradients of a random loss for the input tokens and every parameter of the block."""
    model = ODEViT(embed_dim=24, num_heads=2, mixer="ssog-steered", img_size=32, patch_size=8, num_classes=10,
                   depth=3, solver=solver, scale=1.5).double()
    with torch.no_grad():  # open the steering, so that the field depends on the tokens through every path
        for name, p in model.named_parameters():
            if ".alpha_" in name:
                p.fill_(0.0)
            elif "_steer." in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(2, 17, 24, dtype=torch.float64, generator=g)
    cotangent = torch.randn(z0.shape, dtype=torch.float64, generator=g)
    flow, grid = model.blocks, (4, 4)
    params = list(flow.block.parameters())

    def solve(by_odeint):
        z = z0.clone().requires_grad_()
        if by_odeint:
            out = odeint(_Field(flow.block, flow.scale, grid), z, flow.time_grid(z), method=solver)[-1]
        else:
            out = flow(z, grid)
        return out, torch.autograd.grad(out, [z, *params], cotangent)

    (got, got_grads), (want, want_grads) = solve(False), solve(True)
    assert flow.stepped and (want - z0).abs().max() > 1e-2  # the model's own steps, and the field moves the tokens
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * max(1.0, float(b.abs().max())))
