"""The C kernel for steered SSoG (``ssogvit.backends.cpu``): its whole mixing and its tables against the torch path and
the dense float64 reference, its refusals, and how it is built, cached, and replaced when it cannot be."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ssogvit import ops, reference
from ssogvit.backends import _common as backend, cpu
from ssogvit.backends._common import grid_offsets

# only a machine without a C compiler skips these; where one exists, a kernel that fails its build or its probe fails
# the tests below (they require it)
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="no C compiler: the kernel is not built")

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _operands(b, gh, gw, h, r, dh, p, dtype, spread=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = gh * gw
    values = torch.randn(b, p + n, h * dh, generator=g, dtype=dtype)
    mu = torch.randn(b, n, h, r, 2, generator=g, dtype=dtype) * spread  # centres inside and outside the grid
    sigma = torch.rand(b, n, h, r, 2, generator=g, dtype=dtype) * 2 + 0.02  # narrow (0.02 cells) to wide
    lam = torch.softmax(torch.randn(b, n, h, r, generator=g, dtype=dtype) * 2, -1)
    tau = torch.tensor(0.8, dtype=dtype)
    return values, mu, sigma, lam, tau


@pytest.mark.parametrize("grid", [(1, 7), (5, 7), (14, 14), (3, 40)])
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("chunk", [1, 2, None])
def test_inference_equals_the_torch_path_and_the_dense_reference(grid, prefix, chunk):
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        values, mu, sigma, lam, tau = _operands(2, *grid, 3, 4, 2, prefix, dtype)
        with torch.no_grad():
            with cpu.enabled(True):
                fast = ops.ssog_mix_steered(values, grid, mu, sigma, lam, tau, head_chunk=chunk)
            with cpu.enabled(False):
                plain = ops.ssog_mix_steered(values, grid, mu, sigma, lam, tau, head_chunk=chunk)
        a = reference.with_prefix(reference.dense_steered_matrix(*(t.double() for t in (mu, sigma, lam, tau)), grid),
                                  prefix)
        dense = reference.dense_mix(a, values.double())
        scale = dense.abs().max()
        assert float((fast.double() - dense).abs().max() / scale) < tol, dtype
        assert float((fast - plain).abs().max() / scale) < tol, dtype


def test_the_kernel_is_built_and_agrees_with_the_torch_path_and_the_dense_reference():
    """Its first use builds it and checks its tables against the torch path and its mixing against the dense
    reference (``cpu.available``), without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.available(ops.gaussian_rows)


def _dense(values, mu, sigma, lam, tau, grid, prefix):
    a = reference.with_prefix(reference.dense_steered_matrix(*(t.double() for t in (mu, sigma, lam, tau)), grid),
                              prefix)
    return reference.dense_mix(a, values.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_mixing_kernel_equals_the_dense_reference_in_place_and_out_of_place(dtype):
    """``steered_mix`` itself, at widths that use its register tiles and their remainders (dh = 20: one 16-wide
    float32 tile or two 8-wide float64 tiles, then 4 columns one by one), R = 3 atoms (a tile of 3 rows), rows of 7
    queries (a tile of 4 and one of 3), written over the values or into another tensor, with 1 or 2 threads."""
    grid, tol = (5, 7), 2e-6 if dtype == torch.float32 else 1e-12
    values, mu, sigma, lam, tau = _operands(2, *grid, 2, 3, 20, 1, dtype, seed=3)
    scale = ops.kernel_scale(sigma, tau)
    dense = _dense(values, mu, sigma, lam, tau, grid, 1)
    threads, results = torch.get_num_threads(), []
    try:
        for n, inplace in ((1, False), (max(2, threads), False), (max(2, threads), True)):
            torch.set_num_threads(n)
            out = values.clone() if inplace else torch.full_like(values, float("nan"))
            assert cpu.steered_mix(out, out if inplace else values, grid, mu, scale, lam, ops.gaussian_rows)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    for out in results:
        err = (out[:, 1:].double() - dense[:, 1:]).abs().max() / dense.abs().max()
        assert float(err) < tol
    assert torch.equal(results[2][:, 0], values[:, 0])  # the prefix row is the caller's: left alone
    assert torch.isnan(results[0][:, 0]).all() and torch.isnan(results[1][:, 0]).all()
    assert torch.equal(results[0][:, 1:], results[1][:, 1:]) and torch.equal(results[1][:, 1:], results[2][:, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid,prefix", [((5, 7), 1), ((1, 7), 0), ((14, 14), 2)])
def test_fixed_mixing_by_the_kernel_equals_the_dense_reference_and_the_stacked_path(dtype, grid, prefix):
    """``ssog_mix(impl="auto")`` on the CPU without autograd mixes with the kernel (its tables given): the dense
    float64 reference and ``impl="stacked"`` agree, in place and not."""
    h, r, dh, tol = 3, 3, 20, 2e-6 if dtype == torch.float32 else 1e-12
    g = torch.Generator().manual_seed(5)
    values = torch.randn(2, prefix + grid[0] * grid[1], h * dh, generator=g, dtype=dtype)
    mu, sigma = torch.randn(h, r, 2, generator=g, dtype=dtype) * 2, torch.rand(h, r, 2, generator=g, dtype=dtype) + .1
    lam, tau = torch.softmax(torch.randn(h, r, generator=g, dtype=dtype), -1), torch.tensor(0.7, dtype=dtype)
    ky, kx = (reference.dense_axis_kernel(n, mu[..., i], sigma[..., i], tau) for i, n in enumerate(grid))
    dense = reference.dense_mix(reference.with_prefix(reference.dense_fixed_matrix(
        *(t.double() for t in (mu, sigma, lam, tau)), grid), prefix), values.double())
    with torch.no_grad():
        assert cpu.mixes(values, (ky, kx, lam), ops.gaussian_rows)
        auto = ops.ssog_mix(values, grid, ky, kx, lam)
        stacked = ops.ssog_mix(values, grid, ky, kx, lam, impl="stacked")
        inplace = ops.ssog_mix(values.clone(), grid, ky, kx, lam, inplace=True)
    for out in (auto, stacked, inplace):
        assert float((out.double() - dense).abs().max() / dense.abs().max()) < tol
    assert torch.equal(auto, inplace)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_backward_kernel_equals_autograd_through_the_dense_reference(dtype):
    """``steered_mix_grad`` (the steered backward without a second derivative) at widths and atom counts that use its
    register tiles' remainders, with prefix tokens, with 1 or 2 threads (equal bit for bit): the gradients of the
    values, ``mu``, ``scale`` and ``lam`` against autograd through the dense float64 reference."""
    grid, tol = (5, 7), 1e-5 if dtype == torch.float32 else 1e-11
    values, mu, sigma, lam, tau = _operands(2, *grid, 2, 3, 20, 2, dtype, seed=7)
    scale = ops.kernel_scale(sigma, tau)
    grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(8), dtype=dtype)
    inputs = [t.to(torch.float64, copy=True).requires_grad_() for t in (values, mu, scale, lam)]
    a = reference.dense_steered_matrix(inputs[1], 1 / inputs[2], inputs[3], torch.tensor(0.5, dtype=torch.float64),
                                       grid)  # tau = 1/2: the reference's scale is 1 / sigma
    want = torch.autograd.grad((reference.dense_mix(reference.with_prefix(a, 2), inputs[0]) * grad.double()).sum(),
                               inputs)
    threads, got = torch.get_num_threads(), []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            g_values, g_geo = cpu.steered_mix_grad(values, grad, grid, mu, scale, lam, ops.gaussian_rows)
            backend.add_prefix_grad(g_values, grad, 2)
            got.append((g_values, *g_geo))
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(got[0], want):
        assert float((x.double() - y).abs().max() / y.abs().max()) < tol
    assert all(torch.equal(x, y) for x, y in zip(*got))


def test_what_the_mixing_kernel_refuses_goes_to_the_torch_path():
    """``steered_mix`` answers ``False`` and writes nothing where it cannot mix faithfully."""
    values, mu, sigma, lam, tau = _operands(1, 3, 4, 2, 2, 4, 1, torch.float32)
    scale = ops.kernel_scale(sigma, tau)
    out = torch.zeros_like(values)
    refused = [
        (values.half(), out.half(), mu.half(), scale.half(), lam.half()),  # a dtype it has no kernel for
        (values, out, mu.double(), scale, lam),  # mixed dtypes
        (values.clone().requires_grad_(), out, mu, scale, lam),  # autograd through it
        (torch.zeros(1, 13, 16)[..., ::2], out, mu, scale, lam),  # the values' rows not unit stride
        (values, torch.zeros(1, 13, 16)[..., ::2], mu, scale, lam),  # nor the output's
    ]
    for args in refused:
        with torch.enable_grad():
            assert not cpu.steered_mix(args[1], args[0], (3, 4), *args[2:], ops.gaussian_rows)
    assert (out == 0).all()
    with cpu.enabled(False):
        assert not cpu.steered_mix(out, values, (3, 4), mu, scale, lam, ops.gaussian_rows)
    assert (out == 0).all()
    assert cpu.steered_mix(out, values, (3, 4), mu, scale, lam, ops.gaussian_rows) and (out[:, 1:] != 0).any()


def test_training_gradients_equal_the_torch_path():
    """The backward recomputes its tables with the kernel (no autograd through it): the same gradients."""
    grid = (5, 6)
    ops_in = [t.requires_grad_() for t in _operands(2, *grid, 2, 3, 2, 1, torch.float64)]
    grads = {}
    for on in (True, False):
        with cpu.enabled(on):
            y = ops.ssog_mix_steered(ops_in[0], grid, *ops_in[1:], head_chunk=1)
            grads[on] = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum(),
                                            ops_in)
    for a, b in zip(grads[True], grads[False]):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_equal_gaussian_rows_at_the_extremes(dtype):
    """Centres far outside the grid and kernels far narrower than a cell: each row still sums to 1 (its largest
    entry is found without underflow), and entries the torch path flushes are zero here too."""
    q, r = 9, 4
    mu = torch.tensor([0.0, 0.49, -30.0, 200.0], dtype=dtype).expand(2, 3, q, r).contiguous()[..., None]
    s = torch.tensor([0.01, 40.0, 3.0, 1e3], dtype=dtype).expand(2, 3, q, r).contiguous()[..., None]
    lam = torch.rand(2, 3, q, r, 1, dtype=dtype)
    want = ops.gaussian_rows(grid_offsets(q, dtype, "cpu")[:, None, :], mu, s, inplace=True)
    got = cpu.steered_rows(mu, s, None, ops.gaussian_rows)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), rtol=tol, atol=tol)
    assert torch.equal(got == 0, want == 0) or (got - want).abs().max() < torch.finfo(dtype).tiny * 2
    weighted = cpu.steered_rows(mu, s, lam, ops.gaussian_rows)
    torch.testing.assert_close(weighted, want * lam, rtol=tol, atol=tol)
    assert not ((weighted != 0) & (weighted.abs() < torch.finfo(dtype).tiny)).any()  # no denormal left


def test_large_tables_split_between_threads_give_the_same_rows():
    mu = torch.randn(8, 2, 48, 4, 1) * 3  # 147k entries: split between the threads
    s = torch.rand(8, 2, 48, 4, 1) + 0.1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.steered_rows(mu, s, None, ops.gaussian_rows)
        torch.set_num_threads(max(2, threads))
        many = cpu.steered_rows(mu, s, None, ops.gaussian_rows)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_under_torch_compile_the_tables_are_left_to_the_compiler(monkeypatch):
    mu, s = torch.zeros(2, 1, 4, 3, 1), torch.ones(2, 1, 4, 3, 1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cpu.steered_rows(mu, s, None, ops.gaussian_rows) is None  # a ctypes call would break the graph


def test_what_the_kernel_refuses_goes_to_the_torch_path():
    """``steered_rows`` answers ``None`` (the caller then builds the table with torch) for what it cannot read
    faithfully: a layout other than contiguous (C, Q, R) blocks, mixed dtypes or shapes, autograd, other dtypes."""
    mu, s = torch.zeros(2, 1, 4, 3, 1), torch.ones(2, 1, 4, 3, 1)
    assert cpu.steered_rows(mu, s, None, ops.gaussian_rows) is not None
    strided = torch.zeros(2, 1, 4, 3, 2)[..., :1]  # atoms two apart
    assert cpu.steered_rows(strided, s, None, ops.gaussian_rows) is None
    assert cpu.steered_rows(mu, s.double(), None, ops.gaussian_rows) is None
    assert cpu.steered_rows(mu, s[:1], None, ops.gaussian_rows) is None
    assert cpu.steered_rows(mu.half(), s.half(), None, ops.gaussian_rows) is None
    assert cpu.steered_rows(mu.expand(2, 1, 4, 3, 2), s.expand(2, 1, 4, 3, 2), None, ops.gaussian_rows) is None
    assert cpu.steered_rows(mu.requires_grad_(), s, None, ops.gaussian_rows) is None
    heads = torch.zeros(2, 1, 3, 4, 3, 1)[:, :, 1:]  # a head slice of a contiguous tensor: read in place
    assert cpu.steered_rows(heads, torch.ones(2, 1, 3, 4, 3, 1)[:, :, 1:], None, ops.gaussian_rows) is not None
    assert cpu.steered_rows(heads, torch.ones(2, 1, 2, 4, 3, 1), None, ops.gaussian_rows) is None  # other layout
    with cpu.enabled(False):
        assert cpu.steered_rows(mu.detach(), s, None, ops.gaussian_rows) is None


_CHILD = """
import json, os, sys, warnings
import torch
warnings.simplefilter("always")
from ssogvit import ops
from ssogvit.backends import _common as backend, cpu
tiny = torch.finfo(torch.float32).tiny
with warnings.catch_warnings(record=True) as caught:
    used = cpu.available(ops.gaussian_rows)
    cpu.available(ops.gaussian_rows)
    g = torch.Generator().manual_seed(0)
    v, mu, sigma = torch.randn(1, 13, 4, generator=g), torch.randn(1, 12, 2, 2, 2, generator=g), torch.rand(1, 12, 2, 2, 2, generator=g) + 0.3
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
    assert cpu.available(ops.gaussian_rows)
with torch.inference_mode():
    y = fixed(x, grid=(3, 4)), steered(x, grid=(3, 4))
assert all(bool(torch.isfinite(t).all()) for t in y)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": SRC}  # the suite's kernel cache: the check runs per process, not per build
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_built_once_cached_replaced_without_a_compiler_and_loading_it_leaves_denormals_alone(tmp_path):
    """In fresh processes: the first builds the library into the cache, the second loads it from there; without a
    compiler one warning and the torch path's result; ``SSOGVIT_CPU_KERNEL=0`` builds nothing."""
    first = _child(tmp_path)
    assert first["used"] and first["warnings"] == []
    assert first["denormal_kept"]  # the library was not linked with -ffast-math's process-wide flush-to-zero
    (lib,) = (tmp_path / "cache").glob("cpu_steered-*.so")
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
