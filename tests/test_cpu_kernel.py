"""The C kernel (``ssogvit.backends.cpu``): its mixing and its backwards, fixed and steered, against the torch backend
and the dense float64 reference, as registered torch ops (``torch.library.opcheck``), what it refuses, and how it is
built, cached, and replaced when it cannot be."""

import inspect
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ssogvit import core, ops, reference
from ssogvit.backends import cpu

# only a machine without a C compiler skips these; where one exists, a kernel that fails its build or its probe fails
# the tests below (they require it)
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="no C compiler: the kernel is not built")

SRC = str(Path(__file__).resolve().parents[1] / "src")
OPS = torch.ops.ssogvit


def _operands(b, gh, gw, h, r, dh, p, dtype, spread=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = gh * gw
    values = torch.randn(b, p + n, h * dh, generator=g, dtype=dtype)
    mu = torch.randn(b, n, h, r, 2, generator=g, dtype=dtype) * spread  # centres inside and outside the grid
    sigma = torch.rand(b, n, h, r, 2, generator=g, dtype=dtype) * 2 + 0.02  # narrow (0.02 cells) to wide
    lam = torch.softmax(torch.randn(b, n, h, r, generator=g, dtype=dtype) * 2, -1)
    tau = torch.tensor(0.8, dtype=dtype)
    return values, mu, sigma, lam, tau


def _fixed_operands(b, grid, h, r, dh, p, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(b, p + grid[0] * grid[1], h * dh, generator=g, dtype=dtype)
    mu, sigma = torch.randn(h, r, 2, generator=g, dtype=dtype) * 2, torch.rand(h, r, 2, generator=g, dtype=dtype) + .1
    lam, tau = torch.softmax(torch.randn(h, r, generator=g, dtype=dtype), -1), torch.tensor(0.7, dtype=dtype)
    ky, kx = (core.axis_kernels(n, mu[..., i], sigma[..., i], tau).to(dtype) for i, n in enumerate(grid))
    return values, ky, kx, lam


def _dense_steered(values, mu, sigma, lam, tau, grid, prefix):
    a = reference.with_prefix(reference.dense_steered_matrix(*(t.double() for t in (mu, sigma, lam, tau)), grid),
                              prefix)
    return reference.dense_mix(a, values.double())


def _dense_fixed(values, ky, kx, lam, prefix):
    """``dense_mix`` of ``sum_r lam kron(ky, kx)`` in float64, differentiable in every argument."""
    h, r, gh, _ = ky.shape
    gw = kx.shape[-1]
    a = torch.einsum("hr,hrac,hrbd->habcd", lam, ky, kx).reshape(h, gh * gw, gh * gw)
    return reference.dense_mix(reference.with_prefix(a, prefix).expand(values.shape[0], -1, -1, -1), values)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _close(a, b, tol):
    """``_rel(a, b) < tol``, and exact zeros where ``b`` is all zeros (an axis of one cell moves nothing)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) <= tol * float(b.abs().max())


def _with_threads(fn, counts):
    threads = torch.get_num_threads()
    try:
        out = []
        for n in counts:
            torch.set_num_threads(n)
            out.append(fn())
        return out
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_is_built_and_agrees_with_the_dense_reference():
    """Its first use builds it and checks its mixing and backwards against the dense reference (``cpu.available``),
    without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.available()


@pytest.mark.parametrize("grid", [(1, 7), (5, 7), (14, 14), (3, 40)])
@pytest.mark.parametrize("prefix", [0, 1])
def test_steered_inference_equals_the_torch_backend_and_the_dense_reference(grid, prefix):
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        values, mu, sigma, lam, tau = _operands(2, *grid, 3, 4, 2, prefix, dtype)
        with torch.no_grad():
            fast = ops.ssog_mix_steered(values, grid, mu, sigma, lam, tau, impl="cpu")
            plain = ops.ssog_mix_steered(values, grid, mu, sigma, lam, tau, impl="stacked")
        dense = _dense_steered(values, mu, sigma, lam, tau, grid, prefix)
        assert _rel(fast, dense) < tol, dtype
        assert float((fast - plain).abs().max() / dense.abs().max()) < tol, dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_steered_ops_equal_the_dense_reference_in_place_and_out_of_place(dtype):
    """The mixing op itself, at widths that use its register tiles and their remainders (dh = 20: one 16-wide
    float32 tile or two 8-wide float64 tiles, then 4 columns one by one), R = 3 atoms (a tile of 3 rows), rows of 7
    queries (a tile of 4 and one of 3), written over the values or into a new tensor, with 1 or 2 threads (equal
    bit for bit)."""
    grid, tol = (5, 7), 2e-6 if dtype == torch.float32 else 1e-12
    values, mu, sigma, lam, tau = _operands(2, *grid, 2, 3, 20, 1, dtype, seed=3)
    scale = core.kernel_scale(sigma, tau)
    dense = _dense_steered(values, mu, sigma, lam, tau, grid, 1)

    def in_place():
        out = values.clone()
        OPS.cpu_steered_mix_(out, mu, scale, lam, *grid)
        return out

    results = _with_threads(lambda: OPS.cpu_steered_mix(values, mu, scale, lam, *grid), (1, 2)) + [in_place()]
    for out in results:
        assert _rel(out, dense) < tol
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid,prefix", [((5, 7), 1), ((1, 7), 0), ((14, 14), 2)])
def test_fixed_mixing_by_the_kernel_equals_the_dense_reference_and_the_stacked_path(dtype, grid, prefix):
    """``ssog_mix`` on the CPU mixes with the kernel (``impl="auto"``), in place and not: the dense float64
    reference and ``impl="stacked"`` agree."""
    values, ky, kx, lam = _fixed_operands(2, grid, 3, 3, 20, prefix, dtype)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    dense = _dense_fixed(values.double(), ky.double(), kx.double(), lam.double(), prefix)
    assert ops.backend_for("fixed", "auto", values, ky, kx, lam) == "cpu"
    with torch.no_grad():
        auto = ops.ssog_mix(values, grid, ky, kx, lam)
        stacked = ops.ssog_mix(values, grid, ky, kx, lam, impl="stacked")
        inplace = ops.ssog_mix(values.clone(), grid, ky, kx, lam, inplace=True)
    for out in (auto, stacked, inplace):
        assert _rel(out, dense) < tol
    assert torch.equal(auto, inplace)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_steered_backward_op_equals_autograd_through_the_dense_reference(dtype):
    """The steered backward at widths and atom counts that use its register tiles' remainders, with prefix tokens,
    with 1 or 2 threads (equal bit for bit): the gradients of the values, ``mu``, ``scale`` and ``lam`` against
    autograd through the dense float64 reference."""
    grid, tol = (5, 7), 1e-5 if dtype == torch.float32 else 1e-11
    values, mu, sigma, lam, tau = _operands(2, *grid, 2, 3, 20, 2, dtype, seed=7)
    scale = core.kernel_scale(sigma, tau)
    grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(8), dtype=dtype)
    inputs = [t.to(torch.float64, copy=True).requires_grad_() for t in (values, mu, scale, lam)]
    a = reference.dense_steered_matrix(inputs[1], 1 / inputs[2], inputs[3], torch.tensor(0.5, dtype=torch.float64),
                                       grid)  # tau = 1/2: the reference's scale is 1 / sigma
    want = torch.autograd.grad((reference.dense_mix(reference.with_prefix(a, 2), inputs[0]) * grad.double()).sum(),
                               inputs)
    got = _with_threads(lambda: OPS.cpu_steered_mix_backward(grad, values, mu, scale, lam, *grid), (1, 2))
    for x, y in zip(got[0], want):
        assert _rel(x, y) < tol
    assert all(torch.equal(x, y) for x, y in zip(*got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid,prefix", [((5, 7), 2), ((1, 7), 0), ((9, 3), 1)])
def test_the_fixed_backward_op_equals_autograd_through_the_dense_reference(dtype, grid, prefix):
    """The fixed backward (values, ``ky``, ``kx``, ``lam``) at a width that uses its tiles' remainders (dh = 20),
    R = 3 atoms, prefix tokens, batch 3, against autograd through the dense float64 reference; 1 or 2 threads give
    the same gradients bit for bit (the kernels' gradients are summed over images in a fixed order)."""
    values, ky, kx, lam = _fixed_operands(3, grid, 2, 3, 20, prefix, dtype, seed=11)
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(12), dtype=dtype)
    inputs = [t.to(torch.float64, copy=True).requires_grad_() for t in (values, ky, kx, lam)]
    want = torch.autograd.grad(_dense_fixed(*inputs, prefix), inputs, grad.double())
    got = _with_threads(lambda: OPS.cpu_fixed_mix_backward(grad, values, ky, kx, lam), (1, 2))
    for name, x, y in zip(("values", "ky", "kx", "lam"), got[0], want):
        assert x.dtype == dtype and _rel(x, y) < tol, name
    assert all(torch.equal(x, y) for x, y in zip(*got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 7, 14, 40])
def test_the_axis_kernels_op_equals_the_dense_reference_forward_and_backward(dtype, length):
    """``cpu_axis_kernels`` (the fixed field's tables) and its backward against ``reference.dense_axis_kernel`` and
    autograd through it, centres inside and far outside the axis, narrow and wide kernels; ``ops.axis_kernels`` takes
    it for CPU float tensors and returns what ``core.axis_kernels`` returns."""
    g = torch.Generator().manual_seed(3)
    mu = torch.randn(3, 5, generator=g, dtype=dtype) * length
    sigma = torch.rand(3, 5, generator=g, dtype=dtype) * length / 2 + 0.1
    tau = torch.tensor(0.7, dtype=dtype)
    leaves = [t.double().requires_grad_() for t in (mu, sigma)]
    want = reference.dense_axis_kernel(length, *leaves, tau.double())
    grad = torch.randn(want.shape, generator=g, dtype=dtype)
    want_grads = torch.autograd.grad(want, leaves, grad.double())
    scale = core.kernel_scale(sigma, tau)
    got = OPS.cpu_axis_kernels(mu, scale, length)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert got.shape == (3, 5, length, length) and got.dtype == dtype and _close(got, want, tol)
    g_mu, g_scale = OPS.cpu_axis_kernels_backward(grad, got, mu, scale)
    # dL/dsigma from dL/dscale: scale = 1 / (sigma sqrt(2 tau))
    assert _close(g_mu, want_grads[0], 10 * tol) and _close(-g_scale * scale / sigma, want_grads[1], 10 * tol)
    assert _close(ops.axis_kernels(length, mu, sigma, tau), core.axis_kernels(length, mu, sigma, tau), tol)
    traced = ops.axis_kernels(length, mu.requires_grad_(), sigma, tau).grad_fn.name()
    assert traced.startswith("GeneratedBackwardFor_ssogvit_cpu_axis_kernels"), traced


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid,prefix", [((5, 7), 1), ((14, 14), 0), ((3, 40), 2)])
def test_the_field_mixing_equals_autograd_through_the_dense_reference(dtype, grid, prefix):
    """``ops.ssog_mix_field`` (a training step's fixed mixing: the C kernel builds the tables from the field) and its
    gradients for the values, ``mu``, ``sigma``, ``lam`` and a per-head ``tau``, against autograd through
    ``reference.dense_fixed_matrix`` in float64; ``impl="stacked"`` (the tables built by torch) agrees."""
    g = torch.Generator().manual_seed(21)
    h, r, dh = 2, 3, 20
    values = torch.randn(2, prefix + grid[0] * grid[1], h * dh, generator=g, dtype=dtype)
    mu = torch.randn(h, r, 2, generator=g, dtype=dtype) * 3
    sigma = torch.rand(h, r, 2, generator=g, dtype=dtype) * 2 + 0.2
    lam = torch.softmax(torch.randn(h, r, generator=g, dtype=dtype), -1)
    tau = torch.rand(h, generator=g, dtype=dtype) + 0.3
    grad = torch.randn(values.shape, generator=g, dtype=dtype)
    dense_in = [t.double().requires_grad_() for t in (values, mu, sigma, lam, tau)]
    a = reference.with_prefix(reference.dense_fixed_matrix(*dense_in[1:], grid), prefix)
    want = reference.dense_mix(a, dense_in[0])
    want = (want, *torch.autograd.grad(want, dense_in, grad.double()))
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    for impl in ("cpu", "stacked"):
        inputs = [t.clone().requires_grad_() for t in (values, mu, sigma, lam, tau)]
        out = ops.ssog_mix_field(inputs[0], grid, *inputs[1:], impl=impl)
        if impl == "cpu":
            assert out.grad_fn.name().startswith("GeneratedBackwardFor_ssogvit_cpu_field_mix")
        got = (out, *torch.autograd.grad(out, inputs, grad))
        for name, x, y in zip(("out", "values", "mu", "sigma", "lam", "tau"), got, want):
            assert x.dtype == dtype and _close(x, y, tol), (impl, name)


@pytest.mark.parametrize("impl", ["cpu", "stacked"])
def test_the_field_mixing_refuses_a_field_that_does_not_fit_the_values(impl):
    """A width the heads do not divide, weights that are not ``(H, R)``, a centre table of another shape or a
    temperature per head of another count: a ``ValueError`` naming the shapes, before any backend (the C kernel
    would mix part of each row and leave the rest unwritten)."""
    mu, sigma = torch.zeros(4, 2, 2), torch.ones(4, 2, 2)
    lam, tau = torch.full((4, 2), 0.5), torch.tensor(0.7)
    cases = [(torch.randn(1, 13, 10), mu, sigma, lam, tau),
             (torch.randn(1, 13, 8), mu, sigma, torch.tensor(1.0), tau),
             (torch.randn(1, 13, 8), mu[:, :1], sigma, lam, tau),
             (torch.randn(1, 13, 8), mu, sigma, lam, torch.ones(5))]
    for values, *field in cases:
        with pytest.raises(ValueError, match="expected mu and sigma"):
            ops.ssog_mix_field(values, (3, 4), *field, impl=impl)


def test_a_gradient_penalty_through_the_field_mixing_equals_einsum():
    """``create_graph=True`` through ``cpu_field_mix`` (its backward then runs on ``core``'s operations): d/dv and
    d/dmu of |d(sum y^2)/dmu|, against the einsum path."""
    g = torch.Generator().manual_seed(4)
    v = torch.randn(2, 1 + 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mu = torch.randn(2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    sigma, tau = torch.ones(2, 2, 2, dtype=torch.float64), torch.tensor(0.8, dtype=torch.float64)
    lam = torch.softmax(torch.randn(2, 2, generator=g, dtype=torch.float64), -1)

    def penalty_grad(impl):
        y = ops.ssog_mix_field(v, (3, 4), mu, sigma, lam, tau, impl=impl)
        (gm,) = torch.autograd.grad(y.square().sum(), mu, create_graph=True)
        return torch.autograd.grad(gm.square().sum(), (v, mu))

    for got, want in zip(penalty_grad("cpu"), penalty_grad("einsum")):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["fixed", "steered"])
def test_training_gradients_equal_the_torch_backend(kind):
    """A training step's gradients through ``ops`` (the kernel forward and backward) equal the torch backend's."""
    grid = (5, 6)
    if kind == "fixed":
        inputs = [t.requires_grad_() for t in _fixed_operands(2, grid, 2, 3, 4, 1, torch.float64)]
        mix = lambda impl: ops.ssog_mix(inputs[0], grid, *inputs[1:], impl=impl)  # noqa: E731
    else:
        inputs = [t.requires_grad_() for t in _operands(2, *grid, 2, 3, 2, 1, torch.float64)]
        mix = lambda impl: ops.ssog_mix_steered(inputs[0], grid, *inputs[1:], head_chunk=1, impl=impl)  # noqa: E731
    grads = {}
    for impl in ("cpu", "stacked"):
        y = mix(impl)
        grads[impl] = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum(),
                                          inputs)
    for a, b in zip(grads["cpu"], grads["stacked"]):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-12


def _rows_by_mixing(mu, scale, lam):
    """The kernel's weighted x-rows ``lam K^x`` of ``Q`` queries for ``M`` (mu, scale, lam) triples ``(M, Q)``: mixed
    as ``M`` heads of one atom on a ``1 x Q`` grid (whose y-kernel is 1) with identity values, the output is the rows.
    """
    m, q = mu.shape
    values = torch.eye(q, dtype=mu.dtype).repeat(1, m)[None]  # (1, Q, M*Q): head h's values the identity
    geo = [torch.stack([torch.zeros_like(t), t], -1).permute(1, 0, 2)[None, :, :, None].contiguous()
           for t in (mu, scale)]  # (1, Q, M, 1, 2): token q's centre and scale for head m
    out = OPS.cpu_steered_mix(values, *geo, lam.T[None, :, :, None].contiguous(), 1, q)
    return out[0].view(q, m, q).transpose(0, 1)  # (M, Q queries, Q sources)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_equal_gaussian_rows_at_the_extremes(dtype):
    """Centres far outside the grid and kernels far narrower than a cell: each row still sums to 1 (its largest
    entry is found without underflow), entries the torch path flushes are zero here too, and lam times a normal
    entry below the smallest normal number is flushed again (no denormal reaches a product)."""
    q = 9
    mu = torch.tensor([0.0, 0.49, -30.0, 200.0], dtype=dtype).repeat_interleave(q).view(4, q)
    s = torch.tensor([0.01, 40.0, 3.0, 1e3], dtype=dtype).repeat_interleave(q).view(4, q)
    want = core.gaussian_rows(core.grid_offsets(q, dtype, "cpu"), mu[..., None], s[..., None])  # (4, Q, Q)
    got = _rows_by_mixing(mu, s, torch.ones_like(mu))
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), rtol=tol, atol=tol)
    assert torch.equal(got == 0, want == 0)
    lam = torch.rand(4, q, dtype=dtype, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_rows_by_mixing(mu, s, lam), want * lam[..., None], rtol=tol, atol=tol)
    tiny = torch.finfo(dtype).tiny
    s_edge = float(-torch.log(torch.tensor(2.1 * tiny, dtype=torch.float64))) ** 0.5  # neighbour exp(-s^2) = 2.1 tiny
    edge = _rows_by_mixing(torch.zeros(1, q, dtype=dtype), torch.full((1, q), s_edge, dtype=dtype),
                           torch.full((1, q), 0.25, dtype=dtype))
    plain = _rows_by_mixing(torch.zeros(1, q, dtype=dtype), torch.full((1, q), s_edge, dtype=dtype),
                            torch.ones(1, q, dtype=dtype))
    assert ((plain[0, 0, 1] > tiny) & (plain[0, 0, 1] * 0.25 < tiny)).all()  # a normal neighbour, denormal x 0.25
    assert edge[0, 0, 1] == 0 and not ((edge != 0) & (edge.abs() < tiny)).any()  # flushed: no denormal left


def test_the_ops_pass_torch_library_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of every op of the kernel, with
    prefix tokens and odd sizes. The two mixings' forward ops have no autograd of their own (``ops`` wires theirs,
    ``test_the_mixings_autograd_is_wired_once_by_ops``), so they are checked without gradients; the field ops with."""
    values, mu, sigma, lam, tau = _operands(2, 3, 4, 2, 3, 5, 1, torch.float64)
    scale = core.kernel_scale(sigma, tau)
    f_values, ky, kx, f_lam = _fixed_operands(2, (3, 4), 2, 3, 5, 1, torch.float64)
    grad = torch.randn_like(values)
    leaves = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    cases = [
        (OPS.cpu_fixed_mix, (f_values, ky, kx, f_lam)),
        (OPS.cpu_fixed_mix_, (f_values.clone(), ky, kx, f_lam)),
        (OPS.cpu_fixed_mix_backward, (grad, f_values, ky, kx, f_lam)),
        (OPS.cpu_steered_mix, (values, mu, scale, lam, 3, 4)),
        (OPS.cpu_steered_mix_, (values.clone(), mu, scale, lam, 3, 4)),
        (OPS.cpu_steered_mix_backward, (grad, values, mu, scale, lam, 3, 4)),
        (OPS.cpu_axis_kernels, (*leaves(mu[0, 0, ..., 0], scale[0, 0, ..., 0]), 5)),
        (OPS.cpu_axis_kernels_backward, (torch.randn(2, 3, 5, 5, dtype=torch.float64), ky, mu[0, 0, ..., 0],
                                         scale[0, 0, ..., 0])),
        (OPS.cpu_field_mix, (*leaves(f_values, mu[0, 0], scale[0, 0], f_lam), 3, 4)),
        (OPS.cpu_field_mix_backward, (grad, f_values, mu[0, 0], scale[0, 0], f_lam, 3, 4)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_the_mixings_autograd_is_wired_once_by_ops():
    """One autograd per op: a training step's mixing by the kernel is ``ops``'s ``_FixedMix`` / ``_SteeredMix`` (which
    call the forward op without autograd and the backward op in their backward); the forward ops themselves have no
    autograd formula, so a backward through them alone is an error, not a second path."""
    values, mu, sigma, lam, tau = _operands(1, 3, 4, 2, 2, 4, 1, torch.float64)
    f_values, ky, kx, f_lam = _fixed_operands(1, (3, 4), 2, 2, 4, 1, torch.float64)
    scale = core.kernel_scale(sigma, tau)
    v = values.clone().requires_grad_()
    assert type(ops.ssog_mix_steered(v, (3, 4), mu, sigma, lam, tau, impl="cpu").grad_fn).__name__ == (
        "_SteeredMixBackward")
    f = f_values.clone().requires_grad_()
    assert type(ops.ssog_mix(f, (3, 4), ky, kx, f_lam, impl="cpu").grad_fn).__name__ == "_FixedMixBackward"
    for op, args in ((OPS.cpu_fixed_mix, (f, ky, kx, f_lam)), (OPS.cpu_steered_mix, (v, mu, scale, lam, 3, 4))):
        with pytest.raises(RuntimeError, match="no autograd formula"):
            op(*args).sum().backward()


def test_what_the_kernel_cannot_mix_goes_to_the_torch_backend_and_is_refused_by_name():
    """The probe: other dtypes, mixed dtypes and the switch turn ``"auto"`` to the torch backend and make
    ``impl="cpu"`` an error that says why; values whose rows are not contiguous are copied, not misread."""
    values, ky, kx, lam = _fixed_operands(1, (3, 4), 2, 2, 4, 1, torch.float32)
    refused = {"got torch.float16": (values.half(), ky.half(), kx.half(), lam.half()),
               "in one dtype": (values, ky.double(), kx, lam)}
    for reason, args in refused.items():
        assert ops.backend_for("fixed", "auto", *args) == "stacked"
        with pytest.raises(RuntimeError, match=reason):
            ops.ssog_mix(args[0], (3, 4), *args[1:], impl="cpu")
    with cpu.enabled(False):
        assert ops.backend_for("fixed", "auto", values, ky, kx, lam) == "stacked"
    strided = torch.randn(1, 13, 16)[..., ::2]
    with torch.no_grad():
        torch.testing.assert_close(ops.ssog_mix(strided, (3, 4), ky, kx, lam, impl="cpu"),
                                   ops.ssog_mix(strided, (3, 4), ky, kx, lam, impl="stacked"), rtol=1e-6, atol=1e-6)


_CHILD = """
import json, os, sys, warnings
import torch
warnings.simplefilter("always")
from ssogvit import ops
from ssogvit.backends import cpu
tiny = torch.finfo(torch.float32).tiny
with warnings.catch_warnings(record=True) as caught:
    used = cpu.available()
    cpu.available()
    g = torch.Generator().manual_seed(0)
    v, mu = torch.randn(1, 13, 4, generator=g), torch.randn(1, 12, 2, 2, 2, generator=g)
    sigma = torch.rand(1, 12, 2, 2, 2, generator=g) + 0.3
    with torch.no_grad():
        y = ops.ssog_mix_steered(v, (3, 4), mu, sigma, torch.full((1, 12, 2, 2), 0.5), torch.tensor(1.0))
print(json.dumps({"used": used, "warnings": [str(w.message) for w in caught], "y": y.flatten().tolist(),
                  "denormal_kept": float(torch.tensor([tiny]) / 4) != 0.0}))
"""


def _child(tmp_path, **env):
    full = {**os.environ, "PYTHONPATH": SRC, "SSOGVIT_CACHE": str(tmp_path / "cache"), **env}
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=full, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_first_use_under_inference_mode_or_autocast_checks_the_kernel_and_mixes():
    """The first use runs the kernel's check, which needs autograd and float32 matmuls: a process whose first SSoG
    call is under ``torch.inference_mode()`` (which ``enable_grad`` cannot lift) and ``torch.autocast`` must still
    pass it, without a warning, and mix (it crashed with "element 0 of tensors does not require grad" before)."""
    code = """
import warnings, torch
warnings.simplefilter("error")
from ssogvit import ops
from ssogvit.backends import cpu
from ssogvit.layers import create_mixer
fixed, steered = create_mixer("ssog", 12, 3).eval(), create_mixer("ssog-steered", 12, 3).eval()
x = torch.randn(2, 13, 12)
with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
    assert cpu.available()
with torch.inference_mode():
    y = fixed(x, grid=(3, 4)), steered(x, grid=(3, 4))
assert all(bool(torch.isfinite(t).all()) for t in y)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": SRC}  # the suite's kernel cache: the check runs per process, not per build
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.slow
def test_built_once_cached_replaced_without_a_compiler_and_loading_it_leaves_denormals_alone(tmp_path):
    """In fresh processes: the first builds the library into the cache, the second loads it from there; without a
    compiler one warning and the torch path's result; ``SSOGVIT_CPU_KERNEL=0`` builds nothing."""
    first = _child(tmp_path)
    assert first["used"] and first["warnings"] == []
    assert first["denormal_kept"]  # the library was not linked with -ffast-math's process-wide flush-to-zero
    (lib,) = (tmp_path / "cache").glob("cpu_kernels-*.so")
    stamp = lib.stat().st_mtime_ns
    second = _child(tmp_path)
    assert second["used"] and lib.stat().st_mtime_ns == stamp  # loaded from the cache, not built again
    assert second["y"] == first["y"]
    broken = _child(tmp_path / "other", CC="false")  # a "compiler" that fails
    assert not broken["used"]
    assert len(broken["warnings"]) == 1 and "not available" in broken["warnings"][0]
    assert "torch path" in broken["warnings"][0]
    torch.testing.assert_close(torch.tensor(broken["y"]), torch.tensor(first["y"]), rtol=2e-6, atol=2e-6)
    off = _child(tmp_path / "off", SSOGVIT_CPU_KERNEL="0")
    assert not off["used"] and off["warnings"] == [] and not (tmp_path / "off" / "cache").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Bands (docs/operator.md, "Bands")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_band_leaves_out_at_most_the_unit_roundoff_of_each_row(dtype):
    """``core.axis_band`` of centres inside and far outside the grid, widths from a tenth of a cell to wider than the
    row: the mass of the dense float64 row outside the band is at most ``finfo(dtype).eps / 2``, the band is never
    empty and holds the row's largest entry; narrow rows keep a band much shorter than the row."""
    g = torch.Generator().manual_seed(3)
    for length in (1, 2, 9, 40, 160):
        mu = torch.cat([torch.randn(150, generator=g) * 4, torch.tensor([-1e3, 1e3, 0.5, -0.5])]).double()
        sigma = torch.exp(torch.rand(mu.shape, generator=g).double() * 7 - 2.5)  # 0.08 to 90 cells
        tau = torch.tensor(0.7, dtype=torch.float64)
        rows = reference.dense_axis_kernel(length, mu, sigma, tau)  # (S, L, L)
        band = core.axis_band(torch.arange(length)[None, :], mu[:, None], core.kernel_scale(sigma, tau)[:, None],
                              length, dtype).long()
        lo, hi = band[..., :1], band[..., 1:]
        j = torch.arange(length)
        inside = (j >= lo) & (j < hi)
        assert (lo >= 0).all() and (hi <= length).all() and (hi > lo).all()
        assert inside.gather(-1, rows.argmax(-1, keepdim=True)).all()
        left_out = (rows * ~inside).sum(-1)
        assert float(left_out.max()) <= torch.finfo(dtype).eps / 2, (length, float(left_out.max()))
        if length == 160:
            narrow = sigma < 1
            assert float((hi - lo)[narrow].float().mean()) < 0.1 * length


def _record_bands(monkeypatch):
    """A record of the kernel's calls, forward (``_mix_into``) and backward (``_fixed_grads``, ``_steered_grads``), as
    ``(call, whether it was given bands)``."""
    assert cpu.available()  # its first-use check done before the record starts
    used = []

    def spy(name, keyword):
        plain = getattr(cpu, name)

        def call(*args, **kwargs):
            bands = inspect.signature(plain).bind(*args, **kwargs).arguments.get(keyword)
            used.append((name, bands is not None))
            return plain(*args, **kwargs)
        monkeypatch.setattr(cpu, name, call)

    for name, keyword in (("_mix_into", "bands"), ("_fixed_grads", "bands"), ("_steered_grads", "band")):
        spy(name, keyword)
    return used


def _forced_bands(monkeypatch):
    """Bands read wherever given (``BAND_FRACTION`` above any fraction), and the record of ``_record_bands``."""
    used = _record_bands(monkeypatch)
    monkeypatch.setattr(cpu, "BAND_FRACTION", 1.0)
    return used


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid,prefix,wide", [((23, 31), 1, False), ((6, 29), 2, False), ((9, 13), 0, True)])
def test_the_banded_mixing_equals_the_dense_reference_forward_and_backward(monkeypatch, dtype, grid, prefix, wide):
    """Fixed (the field's own op, and tables with their bands in inference) and steered (the geometry given, and
    predicted from the tokens by the steering maps), with the bands forced in the forward and the backward: the output
    and the gradients of the values, of every field parameter and of every steering input against autograd through
    the dense float64 reference, to the tolerance of the dense kernels; rectangular grids, prefix tokens, and atoms so
    wide (``wide``) that the band is the whole row."""
    used = _forced_bands(monkeypatch)
    g = torch.Generator().manual_seed(8)
    h, r, dh, b = 2, 3, 5, 2
    n = grid[0] * grid[1]
    values = torch.randn(b, prefix + n, h * dh, generator=g, dtype=dtype)
    grad = torch.randn(values.shape, generator=g, dtype=dtype)
    scale = 40.0 if wide else 1.0
    mu = torch.randn(h, r, 2, generator=g, dtype=dtype) * 3
    sigma = (torch.rand(h, r, 2, generator=g, dtype=dtype) + 0.3) * scale
    lam = torch.softmax(torch.randn(h, r, generator=g, dtype=dtype), -1)
    tau = torch.tensor(0.8, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    band_y, band_x = core.field_bands(mu, core.kernel_scale(sigma, tau), grid, dtype)
    assert wide == all(bool((b[..., 1] - b[..., 0] == m).all()) for b, m in zip((band_y, band_x), grid))

    dense_in = [t.detach().double().requires_grad_() for t in (values, mu, sigma, lam, tau)]
    want = reference.dense_mix(reference.with_prefix(reference.dense_fixed_matrix(*dense_in[1:], grid), prefix),
                               dense_in[0])
    want = (want, *torch.autograd.grad(want, dense_in, grad.double()))
    inputs = [t.clone().requires_grad_() for t in (values, mu, sigma, lam, tau)]
    out = ops.ssog_mix_field(inputs[0], grid, *inputs[1:], impl="cpu")
    for name, x, y in zip(("out", "values", "mu", "sigma", "lam", "tau"),
                          (out, *torch.autograd.grad(out, inputs, grad)), want):
        assert _close(x, y, tol), ("fixed", name)
    ky, kx = (core.axis_kernels(m, mu[..., i], sigma[..., i], tau).to(dtype) for i, m in enumerate(grid))
    inplace = values.clone()
    assert ops.ssog_mix(inplace, grid, ky, kx, lam, impl="cpu", inplace=True, bands=(band_y, band_x)) is inplace
    assert _close(inplace, want[0], tol)

    mu_n = mu + torch.randn(b, n, h, r, 2, generator=g, dtype=dtype)  # per-token geometry
    sigma_n = sigma * torch.exp(torch.randn(b, n, h, r, 2, generator=g, dtype=dtype) * 0.3)
    lam_n = torch.softmax(torch.randn(b, n, h, r, generator=g, dtype=dtype), -1)
    dense_in = [t.detach().double().requires_grad_() for t in (values, mu_n, sigma_n, lam_n)]
    want = _dense_steered(dense_in[0], *dense_in[1:], tau, grid, prefix)
    want = (want, *torch.autograd.grad(want, dense_in, grad.double()))
    inputs = [t.clone().requires_grad_() for t in (values, mu_n, sigma_n, lam_n)]
    out = ops.ssog_mix_steered(inputs[0], grid, *inputs[1:], tau, impl="cpu")
    for name, x, y in zip(("out", "values", "mu", "sigma", "lam"), (out, *torch.autograd.grad(out, inputs, grad)),
                          want):
        assert _close(x, y, tol), ("steered", name)

    width = 6  # the steered geometry predicted from tokens: warm gates, every path steered
    tokens = torch.randn(b, n, width, generator=g, dtype=dtype)
    ell = torch.randn(h, r, generator=g, dtype=dtype)
    steering = [torch.tensor(-1.0, dtype=dtype)] * 3 + [
        torch.randn(shape, generator=g, dtype=dtype) * 0.3 for k in (2 * h * r, 2 * h * r, h * r)
        for shape in ((k, width), (k,))]
    geometry = dict(steer=("mu", "sigma", "lambda"), radius=4.0)
    dense_in = [t.detach().double().requires_grad_() for t in (values, tokens, mu, sigma, ell, tau, *steering)]
    want = _dense_steered(dense_in[0], *core.token_geometry(dense_in[1], *dense_in[2:5], *dense_in[6:], **geometry),
                          dense_in[5], grid, prefix)
    want = (want, *torch.autograd.grad(want, dense_in, grad.double()))
    inputs = [t.clone().requires_grad_() for t in (values, tokens, mu, sigma, ell, tau, *steering)]
    out = ops.ssog_mix_steered_by_tokens(*inputs[:1], grid, *inputs[1:], **geometry, impl="cpu")
    names = ("out", "values", "tokens", "mu", "sigma", "ell", "tau", *(f"steering {i}" for i in range(9)))
    for name, x, y in zip(names, (out, *torch.autograd.grad(out, inputs, grad)), want):
        assert _close(x, y, tol), ("steered by tokens", name)
    forward, fixed, steered = (("_mix_into", True),), (("_fixed_grads", True),), (("_steered_grads", True),)
    # the field's op both ways, the tables' in place, the steered op both ways (given and predicted): all banded
    assert used == [*forward, *fixed, *forward, *forward, *steered, *forward, *steered], used


def test_the_banded_mixing_is_taken_where_the_bands_are_short_and_keeps_non_finite_values_as_the_dense_one(
        monkeypatch):
    """``impl="auto"`` reads the bands where their mean length is at most ``BAND_FRACTION`` of the row (a narrow
    field on a 64 x 48 grid), in inference and both ways of a training step, not where it is more (a 6 x 5 grid); a
    value that is infinite far from a row's band meets that row's zero weights as in the dense mixing (NaN at the same
    places as the torch backend)."""
    used = _record_bands(monkeypatch)
    mixer = SSoGAttentionFor(num_heads=2)
    for grid in ((64, 48), (6, 5)):
        x = torch.randn(1, 1 + grid[0] * grid[1], 16)
        with torch.no_grad():
            mixer(x, grid)
        mixer(x, grid).sum().backward()
    forward, backward = (("_mix_into", True), ("_mix_into", True)), (("_fixed_grads", True),)
    assert used == [*forward, *backward, *((name, False) for name, _ in (*forward, *backward))], used
    values = torch.randn(1, 64 * 48, 16)
    values[0, 5, 3] = float("inf")
    mu, sigma, lam = torch.zeros(2, 2, 2), torch.full((2, 2, 2), 0.7), torch.full((2, 2), 0.5)
    tau = torch.tensor(1.0)
    got, want = (ops.ssog_mix_field(values, (64, 48), mu, sigma, lam, tau, impl=impl) for impl in ("cpu", "stacked"))
    assert used[-1] == ("_mix_into", True) and (got.isnan() == want.isnan()).all() and got.isnan().any()
    finite = want.isfinite()
    assert _close(got[finite], want[finite], 1e-5)


@pytest.mark.parametrize("kind", ["fixed", "steered"])
@pytest.mark.parametrize("where", ["values", "grad", "mu", "lam"])
def test_the_banded_backward_keeps_non_finite_numbers_where_the_dense_one_puts_them(monkeypatch, kind, where):
    """On a grid where the backward reads the bands: an infinite value or output gradient, a NaN centre or weight of
    one atom gives NaN and infinities in every gradient at the places where the torch backend's has them
    (a head with non-finite values or output gradient, a field or geometry with a non-finite number is
    differentiated whole: docs/operator.md, "Bands")."""
    used = _record_bands(monkeypatch)
    grid, n = (64, 48), 64 * 48
    g = torch.Generator().manual_seed(6)
    values, grad = (torch.randn(1, 1 + n, 16, generator=g) for _ in range(2))
    mu, sigma, lam = torch.zeros(2, 2, 2), torch.full((2, 2, 2), 0.7), torch.full((2, 2), 0.5)
    tau = torch.tensor(1.0)
    if kind == "steered":
        mu, sigma, lam = (t.expand(1, n, *t.shape).clone() for t in (mu, sigma, lam))
    places = {"values": (values, (0, 5, 3), "inf"), "grad": (grad, (0, 700, 9), "inf"),
              "mu": (mu, (1, 0, 1) if kind == "fixed" else (0, 900, 1, 0, 1), "nan"),
              "lam": (lam, (0, 1) if kind == "fixed" else (0, 1500, 0, 1), "nan")}
    tensor, index, number = places[where]
    tensor[index] = float(number)
    mix = ops.ssog_mix_field if kind == "fixed" else ops.ssog_mix_steered
    results = []
    for impl in ("cpu", "stacked"):
        leaves = [t.clone().requires_grad_() for t in (values, mu, sigma, lam)]
        results.append(torch.autograd.grad(mix(leaves[0], grid, *leaves[1:], tau, impl=impl), leaves, grad))
    assert used[0] == ("_mix_into", True), used
    for x, y in zip(*results):
        assert (x.isnan() == y.isnan()).all() and (x.isinf() == y.isinf()).all()
        finite = y.isfinite()
        assert _close(x[finite], y[finite], 1e-5)
    assert any(x.isnan().any() for x in results[0])

@pytest.mark.parametrize("kind", ["fixed", "steered"])
def test_the_banded_backward_reads_only_the_bands(monkeypatch, kind):
    """With every atom centred 12 cells right of its query (``sigma`` 0.5), the x-band of no query reaches the first
    columns: there the banded backward, which ``impl="auto"`` takes by itself, gives the values an exact zero
    gradient, where the dense backward (``BAND_FRACTION`` below every fraction) and the dense float64 reference have
    the entries of order ``1e-250`` that the bands leave out; every gradient agrees with the reference."""
    used = _record_bands(monkeypatch)
    dtype, grid, (h, r, dh) = torch.float64, (24, 40), (2, 2, 3)
    g = torch.Generator().manual_seed(4)
    values = torch.randn(1, grid[0] * grid[1], h * dh, generator=g, dtype=dtype)
    grad = torch.randn(values.shape, generator=g, dtype=dtype)
    mu = torch.tensor([0.0, 12.0], dtype=dtype).expand(h, r, 2).clone()
    sigma, tau = torch.full((h, r, 2), 0.5, dtype=dtype), torch.tensor(0.5, dtype=dtype)
    lam = torch.full((h, r), 1 / r, dtype=dtype)
    if kind == "fixed":
        inputs, mix = (values, mu, sigma, lam), lambda v, *a: ops.ssog_mix_field(v, grid, *a, tau, impl="cpu")
        matrix = lambda *a: reference.dense_fixed_matrix(*a, tau, grid)  # noqa: E731
    else:
        n = grid[0] * grid[1]
        inputs = (values, *(t.expand(1, n, *t.shape).clone() for t in (mu, sigma, lam)))
        mix = lambda v, *a: ops.ssog_mix_steered(v, grid, *a, tau, impl="cpu")  # noqa: E731
        matrix = lambda *a: reference.dense_steered_matrix(*a, tau, grid)  # noqa: E731
    dense_in = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(reference.dense_mix(matrix(*dense_in[1:]), dense_in[0]), dense_in, grad)
    got = []
    for fraction in (cpu.BAND_FRACTION, -1.0):
        monkeypatch.setattr(cpu, "BAND_FRACTION", fraction)
        leaves = [t.clone().requires_grad_() for t in inputs]
        got.append(torch.autograd.grad(mix(*leaves), leaves, grad))
    name = "_fixed_grads" if kind == "fixed" else "_steered_grads"
    assert used == [("_mix_into", True), (name, True), ("_mix_into", False), (name, False)], used
    (banded, *_), (dense, *_) = got
    far = torch.arange(grid[0] * grid[1]) % grid[1] < 4  # the tokens of the first four columns
    assert (banded[0, far] == 0).all()
    assert (dense[0, far] != 0).all() and (want[0][0, far] != 0).all()
    for x, y in zip((*got[0], *got[1]), (*want, *want)):
        assert _close(x, y, 1e-12)

def SSoGAttentionFor(num_heads):
    from ssogvit.layers import create_mixer

    torch.manual_seed(0)
    return create_mixer("ssog", dim=16, num_heads=num_heads, impl="cpu")
