"""The SSoG operator against its dense float64 reference, and the paper's claims about it (docs/operator.md)."""

import copy
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from ssogvit import core, ops, reference
from ssogvit.backends import cpu
from ssogvit.backends import torch as torch_backend
from ssogvit.layers import STEER_PATHS, SSoGAttention, create_mixer

# every implementation that runs on the CPU (the C kernel wherever a compiler exists: where it fails its build or
# its check, the tests that ask for it fail)
IMPLS = ["cpu", "stacked", "einsum"] if shutil.which(os.environ.get("CC", "cc")) else ["stacked", "einsum"]
GRIDS = [(1, 7), (5, 7), (14, 14)]
STEERS = [(), ("mu",), ("sigma",), ("lambda",), STEER_PATHS]
PREFIXES = [0, 1, 5]
F64 = dict(dtype=torch.float64)


def make_mixer(steer=(), dim=12, heads=3, atoms=3, open_gates=True, **kw):
    gates = dict(gate_init=-1.0 if open_gates else -8.0) if steer else {}  # a fixed mixer refuses a steering option
    m = SSoGAttention(dim, heads, num_atoms=atoms, steer=steer, **gates, **kw).double()
    with torch.no_grad():  # move off the initial point: non-trivial widths, mixtures, temperature, steering maps
        m.rho.normal_(0.0, 0.7)
        m.ell.normal_(0.0, 1.0)
        m.theta.fill_(0.3)
        for name, p in m.named_parameters():
            if "_steer" in name:
                p.normal_(0.0, 0.5)
    return m


def dense_forward(m, x, grid):
    """Reference output: proj(A @ V) with A materialised by ssogvit.reference."""
    a = m.attention_matrix(x, grid, num_prefix_tokens=x.shape[1] - grid[0] * grid[1])
    return m.proj(reference.dense_mix(a, m.v(x)))


def rel_err(a, b):
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).detach())


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("steer", STEERS, ids=lambda s: "+".join(s) or "fixed")
@pytest.mark.parametrize("prefix", PREFIXES)
def test_fast_path_equals_dense_reference_forward_and_gradients(grid, steer, prefix):
    m = make_mixer(steer)
    x = torch.randn(2, prefix + grid[0] * grid[1], 12, **F64, requires_grad=True)
    y_ref = dense_forward(m, x, grid)
    w = torch.randn_like(y_ref)
    params = [x] + list(m.parameters())
    g_ref = torch.autograd.grad((y_ref * w).sum(), params)
    for impl in IMPLS:
        m.impl = impl
        y = m(x, grid=grid, num_prefix_tokens=prefix)
        assert rel_err(y, y_ref) < 1e-10, impl
        g = torch.autograd.grad((y * w).sum(), params, allow_unused=True)
        for (name, _), gi, gr in zip([("x", None)] + list(m.named_parameters()), g, g_ref):
            assert gi is not None, f"{impl}: no gradient for {name}"
            assert rel_err(gi, gr) < 1e-10, f"{impl}: gradient of {name}"


@pytest.mark.parametrize("grid", [(1, 7), (3, 4)])
@pytest.mark.parametrize("steer", STEERS, ids=lambda s: "+".join(s) or "fixed")
@pytest.mark.parametrize("impl", IMPLS[:-1])
def test_gradcheck_fast_path(grid, steer, impl):
    m = make_mixer(steer, dim=6, heads=2, atoms=2, impl=impl)
    names = [n for n, _ in m.named_parameters()]
    x = torch.randn(1, 1 + grid[0] * grid[1], 6, **F64, requires_grad=True)

    def f(x, *params):
        return torch.func.functional_call(m, dict(zip(names, params)), (x,), {"grid": grid})

    assert torch.autograd.gradcheck(f, (x, *[p.detach().requires_grad_() for p in m.parameters()]), fast_mode=True)


@pytest.mark.parametrize("steer", STEERS, ids=lambda s: "+".join(s) or "fixed")
def test_every_row_of_the_mixing_matrix_sums_to_one(steer):
    m = make_mixer(steer)
    x = torch.randn(2, 3 + 5 * 6, 12, **F64)
    a = m.attention_matrix(x, (5, 6), num_prefix_tokens=3)
    assert a.shape == (2, 3, 33, 33)
    assert (a >= 0).all()
    torch.testing.assert_close(a.sum(-1), torch.ones(2, 3, 33, **F64), atol=1e-12, rtol=0)


def test_patches_never_receive_mass_from_prefix_tokens():
    m = make_mixer(STEER_PATHS)
    grid, p = (4, 5), 3
    x = torch.randn(2, p + 20, 12, **F64)
    a = m.attention_matrix(x, grid, num_prefix_tokens=p)
    assert torch.count_nonzero(a[..., p:, :p]) == 0
    # and the output at the patches does not change when the prefix tokens do
    x2 = x.clone()
    x2[:, :p] = torch.randn(2, p, 12, **F64) * 10
    y, y2 = m(x, grid=grid, num_prefix_tokens=p), m(x2, grid=grid, num_prefix_tokens=p)
    torch.testing.assert_close(y[:, p:], y2[:, p:], atol=1e-12, rtol=0)


def test_prefix_tokens_receive_the_mean_patch_value():
    m = make_mixer()
    x = torch.randn(2, 2 + 12, 12, **F64)
    y = m(x, grid=(3, 4), num_prefix_tokens=2)
    expected = m.proj(m.v(x[:, 2:]).mean(dim=1))
    torch.testing.assert_close(y[:, 0], expected)
    torch.testing.assert_close(y[:, 1], expected)


def test_cold_gates_with_zero_steering_maps_equal_the_fixed_field():
    fixed = SSoGAttention(24, 4, num_atoms=4)
    steered = create_mixer("ssog-steered", 24, 4, num_atoms=4)  # cold gates (-8), zero-initialised maps
    state = {k: v for k, v in steered.state_dict().items() if "steer" not in k and "alpha" not in k}
    fixed.load_state_dict(state)
    x = torch.randn(2, 1 + 6 * 7, 24)
    torch.testing.assert_close(steered(x, grid=(6, 7)), fixed(x, grid=(6, 7)), atol=1e-6, rtol=1e-5)
    # the maps are exactly zero, so the geometry is exactly the fixed field whatever the gates
    mu, sigma, lam = steered.geometry(x[:, 1:])
    torch.testing.assert_close(mu, steered.mu.expand_as(mu))
    torch.testing.assert_close(sigma, steered.sigma().expand_as(sigma))


def test_fixed_ssog_is_translation_equivariant_away_from_the_border():
    m = SSoGAttention(8, 2, num_atoms=3, prefix_pool="none").double()
    with torch.no_grad():
        m.mu.uniform_(-1.0, 1.0)
        m.rho.fill_(-3.0)  # narrow atoms (sigma about 0.3): the tails vanish within a few cells
    gh = gw = 24
    x = torch.zeros(1, gh, gw, 8, **F64)
    x[:, 8:12, 8:12] = torch.randn(1, 4, 4, 8, **F64)
    shifted = torch.roll(x, shifts=(3, 5), dims=(1, 2))
    y = m(x.reshape(1, -1, 8), grid=(gh, gw)).reshape(1, gh, gw, 8)
    y_shifted = m(shifted.reshape(1, -1, 8), grid=(gh, gw)).reshape(1, gh, gw, 8)
    # away from the border the response moves with the input (the bias of V is constant everywhere)
    inner = (slice(None), slice(6, 16), slice(6, 16))
    inner_shifted = (slice(None), slice(9, 19), slice(11, 21))
    torch.testing.assert_close(y_shifted[inner_shifted], y[inner], atol=1e-10, rtol=0)


def test_rows_are_renormalised_at_the_border():
    k = ops.axis_kernels(5, torch.tensor([3.0]), torch.tensor([2.0]), torch.tensor(1.0))
    torch.testing.assert_close(k.sum(-1), torch.ones(1, 5))
    assert k[0, 4].argmax() == 4  # a centre beyond the border puts the most mass on the last cell


def test_rectangular_and_changing_grids_between_calls():
    m = create_mixer("ssog", 16, 2)
    for grid in [(1, 9), (3, 7), (7, 3), (5, 5)]:
        x = torch.randn(2, 1 + grid[0] * grid[1], 16)
        y, a = m(x, grid=grid), m.attention_matrix(x, grid)
        torch.testing.assert_close(y, m.proj(reference.dense_mix(a, m.v(x))), atol=1e-5, rtol=1e-4)


def test_kernel_cache_follows_parameter_updates():
    m = create_mixer("ssog", 16, 2).eval()
    x = torch.randn(1, 1 + 20, 16)
    with torch.no_grad():
        y0 = m(x, grid=(4, 5))
        m.mu.add_(1.0)
        y1 = m(x, grid=(4, 5))
    with torch.enable_grad():
        y_fresh = m(x, grid=(4, 5))
    assert not torch.allclose(y0, y1)
    torch.testing.assert_close(y1, y_fresh.detach())


@pytest.mark.parametrize("update", ["fused_adamw", "data_write"])
def test_kernel_cache_follows_updates_that_keep_the_version_counter(update):
    """A fused optimizer step and a `.data` write change the field without bumping `_version`: an eval forward after
    either must use the new field (it once reused the tables of the old one)."""
    m = create_mixer("ssog", 16, 2)
    x = torch.randn(1, 1 + 20, 16)
    with torch.no_grad():
        m.eval()(x, grid=(4, 5))  # fills the cache
    versions = [p._version for p in (m.mu, m.rho, m.ell, m.theta)]
    if update == "fused_adamw":
        m.train()(x, grid=(4, 5)).square().sum().backward()
        torch.optim.AdamW(m.parameters(), lr=0.1, fused=True).step()
    else:
        m.mu.data += 0.5
    assert [p._version for p in (m.mu, m.rho, m.ell, m.theta)] == versions  # the premise: nothing was bumped
    m.eval()
    with torch.no_grad():
        cached = m(x, grid=(4, 5))
    fresh = create_mixer("ssog", 16, 2, cache_kernels=False).eval()
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(cached, fresh(x, grid=(4, 5)), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["mha", "mha-unfused", "ssog", "ssog-steered"])
def test_mixers_survive_deepcopy_and_give_their_attention_matrix(name):
    m = create_mixer(name, 16, 4).eval()
    x = torch.randn(2, 1 + 12, 16)
    with torch.no_grad():
        y = m(x, grid=(3, 4))
        a = m.attention_matrix(x, grid=(3, 4))
        values = m.v(x) if hasattr(m, "v") else m.qkv(x)[..., 32:]  # SSoG's values, or MHA's value rows
        y2 = m.proj(reference.dense_mix(a, values))  # the matrix is what the forward applies
        y3 = copy.deepcopy(m)(x, grid=(3, 4))
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, y3)
    assert a.shape == (2, 4, 13, 13)
    torch.testing.assert_close(a.sum(-1), torch.ones(2, 4, 13), atol=1e-5, rtol=0)


def test_mha_fused_and_explicit_paths_agree():
    fused = create_mixer("mha", 32, 4).double()
    explicit = create_mixer("mha-unfused", 32, 4).double()
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(2, 17, 32, **F64)
    torch.testing.assert_close(fused(x, grid=(4, 4)), explicit(x, grid=(4, 4)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dim,heads,atoms", [(384, 6, 4), (768, 12, 4), (64, 4, 2)])
def test_mha_minus_fixed_ssog_is_the_query_and_key_projections_minus_the_field(dim, heads, atoms):
    def count(m):
        return sum(p.numel() for p in m.parameters())

    mha = create_mixer("mha", dim, heads)
    ssog = create_mixer("ssog", dim, heads, num_atoms=atoms)
    qk = 2 * dim * dim + 2 * dim  # weights and biases of Q and K
    field = 5 * heads * atoms + 1  # mu, rho (H x R x 2 each), ell (H x R), theta
    assert count(mha) - count(ssog) == qk - field


def test_steering_paths_have_parameters_only_when_switched_on():
    m = create_mixer("ssog-steered", 16, 2, steer=("sigma",))
    names = {n for n, _ in m.named_parameters()}
    assert {"sigma_steer.weight", "sigma_steer.bias", "alpha_sigma"} <= names
    assert not any(n.startswith(("mu_steer", "lambda_steer", "alpha_mu", "alpha_lambda")) for n in names)
    assert m.sigma_steer.out_features == 2 * 2 * 4  # (head, atom, axis)


def test_gate_init_per_path():
    m = create_mixer("ssog-steered", 16, 2, gate_init={"mu": -2.0, "sigma": -8.0, "lambda": -8.0})
    assert float(m.alpha_mu) == -2.0 and float(m.alpha_sigma) == -8.0


# -- bad input -------------------------------------------------------------------------------------------------------


def test_wrong_token_count_names_the_numbers():
    m = create_mixer("ssog", 16, 2)
    with pytest.raises(ValueError, match=r"token count 10 .*Gh=4, Gw=4 \(Gh\*Gw=16\)"):
        m(torch.randn(1, 10, 16), grid=(4, 4))
    with pytest.raises(ValueError, match="grid"):
        m(torch.randn(1, 10, 16))


def test_dim_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"dim \(10\) must be divisible by num_heads \(3\)"):
        create_mixer("ssog", 10, 3)
    with pytest.raises(ValueError, match=r"dim \(10\) must be divisible by num_heads \(3\)"):
        create_mixer("mha", 10, 3)


def test_unknown_steering_path_and_options():
    with pytest.raises(ValueError, match=r"unknown steering path\(s\) \['tau'\]"):
        create_mixer("ssog-steered", 16, 2, steer=("mu", "tau"))
    with pytest.raises(ValueError, match=r"steer=True: expected a subset of \('mu', 'sigma', 'lambda'\), 'all'"):
        create_mixer("ssog", 16, 2, steer=True)
    with pytest.raises(ValueError, match="unknown mixer 'flash'.*'ssog'"):
        create_mixer("flash", 16, 2)
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['num_atoms'\].*valid options"):
        create_mixer("mha", 16, 2, num_atoms=4)
    with pytest.raises(ValueError, match="impl='fft': expected one of 'auto'"):
        create_mixer("ssog", 16, 2, impl="fft")


def test_an_implementation_asked_for_by_name_that_cannot_mix_says_why():
    """``impl="auto"`` falls back silently; a name that cannot mix the input is an error with the reason."""
    x = torch.randn(1, 1 + 12, 16)
    with pytest.raises(RuntimeError, match="no Triton kernel for the steered mixing"):
        create_mixer("ssog-steered", 16, 2, impl="triton")(x, grid=(3, 4))
    with pytest.raises(RuntimeError, match="float32 and float64 CPU tensors, got torch.bfloat16"):
        create_mixer("ssog", 16, 2, impl="cpu").bfloat16()(x.bfloat16(), grid=(3, 4))
    with cpu.enabled(False), pytest.raises(RuntimeError, match="C kernel is turned off"):
        create_mixer("ssog", 16, 2, impl="cpu")(x, grid=(3, 4))
    with cpu.enabled(False):
        assert ops.backend_for("fixed", "auto", x, torch.ones(1), torch.ones(1), torch.ones(1)) == "stacked"


@pytest.mark.parametrize("field,value", [("sigma_min", 0.0), ("sigma_min", -1.0), ("tau_min", 0.0)])
def test_non_positive_bounds(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value}: expected a number > 0"):
        create_mixer("ssog", 16, 2, **{field: value})


@pytest.mark.parametrize("shape", [(17, 16), (1, 2, 17, 16)])
def test_input_must_be_three_dimensional(shape):
    for name in ("ssog", "mha"):
        with pytest.raises(ValueError, match=rf"got a {len(shape)}-D tensor"):
            create_mixer(name, 16, 2)(torch.randn(*shape), grid=(4, 4))


# -- autocast --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ssog", "ssog-steered", "mha"])
def test_runs_under_bfloat16_autocast_on_cpu(name):
    m = create_mixer(name, 32, 4)
    x = torch.randn(2, 1 + 36, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, grid=(6, 6))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), m(x, grid=(6, 6)), atol=0.1, rtol=0.1)


# ---------------------------------------------------------------------------------------------------------------------
# Inference paths: heads mixed in chunks, results written over the values


def _fixed_problem(b, grid, prefix, heads=3, atoms=3, dh=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    gh, gw = grid
    m = make_mixer(dim=heads * dh, heads=heads, atoms=atoms)
    ky, kx, lam = m._fixed_kernels(grid, torch.float64)
    values = torch.randn(b, prefix + gh * gw, heads * dh, generator=g, **F64)
    a = reference.with_prefix(reference.dense_fixed_matrix(m.mu, m.sigma(), m.mixture(), m.tau(), grid), prefix)
    y_ref = reference.dense_mix(a.unsqueeze(0).expand(b, -1, -1, -1), values)
    return values, ky.detach(), kx.detach(), lam.detach(), y_ref


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("inplace", [False, True])
def test_inference_stacked_paths_equal_dense_reference(grid, prefix, batch, chunk, inplace):
    values, ky, kx, lam, y_ref = _fixed_problem(batch, grid, prefix)
    keep = values.clone()
    with torch.no_grad():
        y = ops.ssog_mix(values, grid, ky, kx, lam, impl="stacked", head_chunk=chunk, inplace=inplace)
    assert rel_err(y, y_ref) < 1e-12
    if inplace:
        assert y.data_ptr() == values.data_ptr()  # the values' buffer holds the result
    else:
        assert torch.equal(values, keep)  # the input is left alone


@pytest.mark.parametrize("steer", STEERS[1:], ids=lambda s: "+".join(s))
@pytest.mark.parametrize("prefix", [0, 2])
def test_inference_steered_inplace_equals_dense_reference(steer, prefix):
    m = make_mixer(steer)
    grid = (5, 7)
    x = torch.randn(2, prefix + 35, 12, **F64)
    with torch.no_grad():
        a = m.attention_matrix(x, grid, num_prefix_tokens=prefix)
        values = m.v(x)
        y_ref = reference.dense_mix(a, values)
        mu, sigma, lam = m.geometry(x[:, prefix:])
        for chunk in (1, 2, 3):
            v = values.clone()
            y = ops.ssog_mix_steered(v, grid, mu, sigma, lam, m.tau(), head_chunk=chunk, inplace=True)
            assert y.data_ptr() == v.data_ptr()
            assert rel_err(y, y_ref) < 1e-12, chunk


@pytest.mark.parametrize("steer", [(), STEER_PATHS], ids=["fixed", "steered"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_module_inference_equals_dense_reference(steer, mode):
    """Without autograd the module mixes in place (and, for small inputs, in head chunks); same result."""
    m = make_mixer(steer).eval()
    grid = (5, 7)
    x = torch.randn(2, 1 + 35, 12, **F64)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        y_ref = dense_forward(m, x, grid)
        for chunk in (None, 1, 2):
            m.head_chunk = chunk
            assert rel_err(m(x, grid=grid), y_ref) < 1e-12, chunk


def test_inplace_mixing_refuses_values_that_autograd_needs():
    values, ky, kx, lam, _ = _fixed_problem(1, (3, 4), 1)
    values.requires_grad_(True)
    with pytest.raises(ValueError, match="inplace=True"):
        ops.ssog_mix(values, (3, 4), ky, kx, lam, inplace=True)
    mu = torch.zeros(1, 12, 3, 3, 2, **F64)
    lam_t = torch.full((1, 12, 3, 3), 1 / 3, **F64)
    with pytest.raises(ValueError, match="inplace=True"):
        ops.ssog_mix_steered(values, (3, 4), mu, mu + 1.0, lam_t, torch.tensor(1.0, **F64), inplace=True)


def test_default_mix_head_chunk_batches_heads_only_for_small_problems():
    assert torch_backend.default_mix_head_chunk(196, 12, 4) == 2  # ViT-B at 224, batch 1
    assert torch_backend.default_mix_head_chunk(torch_backend.SMALL_MIX_TOKENS + 1, 12, 4) == 1
    assert torch_backend.default_mix_head_chunk(100, 3, 4) == 1  # fewer heads than atoms + 2


def test_no_denormal_reaches_a_matmul_after_the_mixture_weights_are_folded_in(monkeypatch):
    """Kernel entries just above the smallest normal number, times lambda < 1, would be denormal (several times
    slower matmuls on x86): the torch backend flushes them after folding, in the fixed and the steered paths."""
    tiny = torch.finfo(torch.float32).tiny
    seen = []
    real_matmul, real_bmm = torch.matmul, torch.bmm

    def spy(real):
        def f(a, b, *args, **kw):
            for t in (a, b):
                seen.append(int(((t != 0) & (t.abs() < tiny)).sum()))
            return real(a, b, *args, **kw)
        return f

    h, r, gh, gw, dh = 2, 4, 3, 4, 2
    ky = torch.full((h, r, gh, gh), 2 * tiny)
    ky[..., 0] = 1.0
    kx = torch.eye(gw).expand(h, r, gw, gw).contiguous()
    lam = torch.full((h, r), 0.25)
    values = torch.randn(1, 1 + gh * gw, h * dh)
    monkeypatch.setattr(torch, "matmul", spy(real_matmul))
    monkeypatch.setattr(torch, "bmm", spy(real_bmm))
    with torch.no_grad():
        ops.ssog_mix(values, (gh, gw), ky, kx, lam, impl="stacked", head_chunk=1)
        ops.ssog_mix(values, (gh, gw), ky, kx, lam, impl="stacked", head_chunk=2)

    def near_tiny_rows(delta, mu, scale, inplace=None):
        rows = torch.full(torch.broadcast_shapes(delta.shape, mu.shape, scale.shape), 2 * tiny)
        rows[..., 0] = 1.0
        return rows

    monkeypatch.setattr(core, "gaussian_rows", near_tiny_rows)
    mu = torch.zeros(1, gh * gw, h, r, 2)
    lam = torch.full((1, gh * gw, h, r), 0.25)
    n_before = len(seen)
    with torch.no_grad():  # the torch backend builds its tables with the planted rows
        ops.ssog_mix_steered(values, (gh, gw), mu, mu + 1.0, lam, torch.tensor(1.0), impl="stacked")
    assert len(seen) > n_before  # the steered path ran its matmuls on the planted rows
    assert len(seen) > 0 and sum(seen) == 0, seen
    # the C kernel builds its weighted rows with the same rule (test_cpu_kernel checks them for denormals)


@pytest.mark.parametrize("grid,heads,atoms,dim", [((14, 14), 12, 4, 768), ((64, 64), 12, 4, 768), ((2, 2), 192, 1, 768),
                                                  ((5, 7), 3, 3, 12)])
def test_default_steered_head_chunk_keeps_temporaries_within_a_third_of_the_activation(grid, heads, atoms, dim):
    chunk = torch_backend.default_head_chunk(grid, heads, atoms, dim)
    assert 1 <= chunk <= heads
    per_head = atoms * sum(grid) + 2 * atoms * (dim // heads)
    assert chunk == 1 or chunk * per_head <= dim / 3
    assert (chunk + 1) * per_head > dim / 3 or chunk == heads  # and it takes as many heads as fit


@pytest.mark.parametrize("grid,batch", [((14, 14), 1), ((14, 14), 4), ((24, 24), 1), ((64, 64), 8), ((2, 2), 1)])
def test_training_head_chunk_may_use_a_fixed_byte_budget_where_the_activation_is_small(grid, batch):
    """In training a chunk may hold up to TRAIN_CHUNK_BYTES of temporaries (ViT-B width: four heads at 224 px,
    batch 1), never fewer heads than in inference, and never more than the budget allows."""
    heads, atoms, dim = 12, 4, 768
    infer = torch_backend.default_head_chunk(grid, heads, atoms, dim, batch=batch)
    train = torch_backend.default_head_chunk(grid, heads, atoms, dim, batch=batch, training=True)
    per_head_bytes = 4 * batch * grid[0] * grid[1] * (atoms * sum(grid) + 2 * atoms * (dim // heads))
    assert train >= infer
    assert train == infer or train * per_head_bytes <= torch_backend.TRAIN_CHUNK_BYTES
    assert train == heads or (train + 1) * per_head_bytes > torch_backend.TRAIN_CHUNK_BYTES or train == infer
    if (grid, batch) == ((14, 14), 1):
        assert (infer, train) == (1, 4)
    if grid[0] >= 24 or batch >= 4:
        assert train == infer == 1  # at 384 px, or batch 4, the activation rule already decides


def test_flushing_the_folded_kernels_leaves_their_gradients_intact():
    """The flush after folding lambda changes values below 1e-38 but must not cut the gradient at those entries."""
    tiny = torch.finfo(torch.float32).tiny
    h, r, gh, gw, dh = 2, 4, 3, 4, 2
    ky = torch.full((h, r, gh, gh), 2 * tiny)
    ky[..., 0] = 1.0
    kx = torch.rand(h, r, gw, gw)
    lam = torch.full((h, r), 0.25)
    values = torch.randn(1, 1 + gh * gw, h * dh)
    grads = {}
    for impl in ("stacked", "einsum"):
        k = ky.clone().requires_grad_(True)
        y = ops.ssog_mix(values, (gh, gw), k, kx, lam, impl=impl)
        (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
        grads[impl] = k.grad
    assert grads["stacked"][..., 1:].abs().max() > 1e-3  # a real gradient where the values were flushed
    torch.testing.assert_close(grads["stacked"], grads["einsum"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("impl", IMPLS[:-1])
def test_double_backward_equals_einsum(prefix, impl):
    """A gradient penalty through the fixed mixer: d/dv of |d(sum y^2)/dmu|, the stacked path against plain einsum."""
    torch.manual_seed(0)
    h, r, gh, gw = 2, 2, 3, 4
    v = torch.randn(2, prefix + gh * gw, 8, dtype=torch.float64, requires_grad=True)
    mu = torch.randn(h, r, 2, dtype=torch.float64, requires_grad=True)
    sigma, tau = torch.ones(h, r, 2, dtype=torch.float64), torch.tensor(0.8, dtype=torch.float64)
    lam = torch.softmax(torch.randn(h, r, dtype=torch.float64), -1)

    def penalty_grad(impl):
        ky = ops.axis_kernels(gh, mu[..., 0], sigma[..., 0], tau)
        kx = ops.axis_kernels(gw, mu[..., 1], sigma[..., 1], tau)
        y = ops.ssog_mix(v, (gh, gw), ky, kx, lam, impl=impl)
        (g,) = torch.autograd.grad(y.square().sum(), mu, create_graph=True)
        return torch.autograd.grad(g.square().sum(), (v, mu))

    for got, want in zip(penalty_grad(impl), penalty_grad("einsum")):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_steered_geometry_keeps_the_documented_bounds():
    """docs/operator.md, "Steering geometry": centres move at most s_mu * M, widths by a factor exp(+-s_sigma), the
    mixture stays on the simplex, and a path without a residual keeps the fixed field."""
    g = torch.Generator().manual_seed(0)
    b, n, h, r = 2, 6, 3, 4
    mu, sigma = torch.randn(h, r, 2, generator=g, **F64), torch.rand(h, r, 2, generator=g, **F64) + 0.3
    ell = torch.randn(h, r, generator=g, **F64)
    res = {"mu": 50 * torch.randn(b, n, h, r, 2, generator=g, **F64),
           "sigma": 50 * torch.randn(b, n, h, r, 2, generator=g, **F64),
           "lambda": 50 * torch.randn(b, n, h, r, generator=g, **F64)}
    gates = {p: ops.steer_gate(torch.tensor(a, **F64)) for p, a in zip(res, (0.3, -0.5, 1.0))}
    mu_n, sigma_n, lam_n = ops.steered_geometry(mu, sigma, ell, res, gates, radius=4.0)
    assert mu_n.shape == sigma_n.shape == (b, n, h, r, 2) and lam_n.shape == (b, n, h, r)
    shift = (mu_n - mu).abs()
    assert shift.max() <= gates["mu"] * 4.0 * (1 + 1e-12) and shift.max() > 0.99 * gates["mu"] * 4.0  # saturated
    ratio = (sigma_n / sigma).log().abs()
    assert ratio.max() <= gates["sigma"] * (1 + 1e-12) and ratio.max() > 0.99 * gates["sigma"]
    torch.testing.assert_close(lam_n.sum(-1), torch.ones(b, n, h, **F64), rtol=0, atol=1e-12)
    fixed = ops.steered_geometry(mu, sigma, ell, {"sigma": res["sigma"]}, gates, radius=4.0)
    assert torch.equal(fixed[0], mu)
    torch.testing.assert_close(fixed[2], torch.softmax(ell, -1), rtol=1e-14, atol=0)  # to rounding
    assert torch.equal(fixed[1], sigma_n)


def test_importing_and_mixing_on_cpu_never_loads_the_triton_kernels():
    code = (
        "import sys, torch, ssogvit\n"
        "from ssogvit.layers import SSoGAttention\n"
        "SSoGAttention(8, 2, num_atoms=2)(torch.randn(1, 7, 8), grid=(2, 3))\n"  # impl='auto' on CPU
        "print('loaded' if 'ssogvit.backends._triton_kernels' in sys.modules else 'not loaded')\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "not loaded"


def _steered_operands(b=2, gh=3, gw=4, h=2, r=2, dh=2, p=1, tau_shape=(), dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    n = gh * gw
    values = torch.randn(b, p + n, h * dh, generator=g, dtype=dtype)
    mu = torch.randn(b, n, h, r, 2, generator=g, dtype=dtype) * 1.5
    sigma = torch.rand(b, n, h, r, 2, generator=g, dtype=dtype) + 0.5
    lam = torch.softmax(torch.randn(b, n, h, r, generator=g, dtype=dtype), -1)
    tau = torch.rand(tau_shape, generator=g, dtype=dtype) + 0.5
    return [t.requires_grad_() for t in (values, mu, sigma, lam, tau)]


@pytest.mark.parametrize("impl,chunk", [pytest.param(i, c, marks=[pytest.mark.slow] if c == 1 else [])
                                        for i in IMPLS[:-1] for c in (1, 2)])
def test_steered_backward_is_differentiable_again(impl, chunk):
    """The steered mixing's gradients, and its second derivatives (gradient penalties: a backward that builds a
    graph is the einsum path's), checked numerically in float64 with prefix tokens and per-head temperatures."""
    ops_in = _steered_operands(tau_shape=(2,))
    fn = lambda *a: ops.ssog_mix_steered(a[0], (3, 4), *a[1:], head_chunk=chunk, impl=impl)  # noqa: E731
    assert torch.autograd.gradcheck(fn, ops_in)
    assert torch.autograd.gradgradcheck(fn, ops_in)


def test_steered_training_saves_no_kernel_table():
    """What the steered path keeps for backward grows with the tokens and heads, not with the grid side: the
    values and a few numbers per token, head and atom, never a per-token kernel table (R * Gh entries per token)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    b, gh, gw, h, r, dh = 1, 24, 24, 2, 4, 4
    values, mu, sigma, lam, tau = _steered_operands(b=b, gh=gh, gw=gw, h=h, r=r, dh=dh, dtype=torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ops.ssog_mix_steered(values, (gh, gw), mu, sigma, lam, tau, head_chunk=1)
    n = gh * gw
    table = b * n * h * r * gh * 4  # one y-table in float32 bytes
    per_token = b * n * h * r * 4  # one number per token, head and atom
    assert sum(saved.values()) <= values.numel() * 4 + 16 * per_token < table
    y.sum().backward()  # and the backward runs from what was kept
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (values, mu, sigma, lam, tau))


def test_steered_batch_slices_give_the_same_mixing_and_gradients(monkeypatch):
    """Large batches are mixed a few images at a time (``backends.torch.SLICE_BYTES``); with one image per slice the
    output, the gradients and the double backward equal one slice's."""
    ops_in = _steered_operands(b=3, tau_shape=(2,))
    fn = lambda *a: ops.ssog_mix_steered(a[0], (3, 4), *a[1:], head_chunk=1, impl="stacked")  # noqa: E731
    w = torch.randn(3, 13, 4, dtype=torch.float64)
    whole = fn(*ops_in)
    g_whole = torch.autograd.grad((whole * w).sum(), ops_in)
    monkeypatch.setattr(torch_backend, "SLICE_BYTES", 1)
    assert len(torch_backend.batch_slices(ops_in[0], (3, 4), 2, 2, 1)) == 3
    sliced = fn(*ops_in)
    torch.testing.assert_close(sliced, whole, rtol=1e-13, atol=1e-13)
    for a, b in zip(torch.autograd.grad((sliced * w).sum(), ops_in), g_whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    with torch.no_grad():
        torch.testing.assert_close(fn(*(t.detach() for t in ops_in)), whole.detach(), rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradgradcheck(fn, ops_in, fast_mode=True)


def test_steered_layer_training_keeps_no_per_token_geometry():
    """The steered layer's training step keeps for backward what the fixed one keeps (its values and the mixed
    output, besides the input, which the value projection keeps anyway) and the steering maps' outputs (5 H R numbers
    per token, which spare backward the maps' matmul): the per-token geometry is recomputed in backward
    (``ops.ssog_mix_steered_by_tokens``), not kept (its ``mu``, ``s``, ``lambda`` and their intermediates through
    tanh, exp and softmax). Gradients still match the unsaved dense reference."""
    dim, heads, atoms, grid = 48, 4, 4, (8, 8)
    kept = {}
    for steer in ((), STEER_PATHS):
        m = make_mixer(steer, dim=dim, heads=heads, atoms=atoms)
        x = torch.randn(2, 1 + grid[0] * grid[1], dim, **F64, requires_grad=True)
        skip = {t.untyped_storage().data_ptr() for t in (x, *m.parameters())}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x, grid=grid)
        kept[steer] = sum(saved.values())
        w = torch.randn_like(y)
        y_ref = dense_forward(m, x, grid)
        params = [x, *m.parameters()]
        for g, g_ref in zip(torch.autograd.grad((y * w).sum(), params), torch.autograd.grad((y_ref * w).sum(), params)):
            assert rel_err(g, g_ref) < 1e-10
    outputs = 2 * grid[0] * grid[1] * 5 * heads * atoms * 8  # bytes: the maps' outputs, 5 H R per patch token
    field = 8 * heads * atoms * 8  # a few numbers per head and atom
    assert kept[()] <= 2 * x.numel() * 8 + field  # values + mixed output
    assert kept[STEER_PATHS] <= kept[()] + outputs + field  # the geometry and its intermediates are several times that
@pytest.mark.parametrize("bad", ["kx_grid", "ky_heads", "lam_atoms", "no_heads", "heads_not_dividing", "lam_1d"])
def test_fixed_mixing_refuses_kernels_that_do_not_fit_the_grid_or_each_other(bad):
    """The C kernel reads the tables by the grid's sizes: tables of another grid or head count must be refused in
    one line (they were mixed silently), through ``ops.ssog_mix``, the public entry point."""
    v = torch.randn(1, 1 + 12, 8)
    ky, kx, lam = torch.rand(2, 3, 3, 3), torch.rand(2, 3, 4, 4), torch.rand(2, 3)
    ky, kx, lam = {"kx_grid": (ky, torch.rand(2, 3, 5, 5), lam), "ky_heads": (torch.rand(4, 3, 3, 3), kx, lam),
                   "lam_atoms": (ky, kx, lam[:, :2]), "no_heads": (ky[:0], kx[:0], lam[:0]),
                   "heads_not_dividing": (torch.rand(3, 3, 3, 3), torch.rand(3, 3, 4, 4), torch.rand(3, 3)),
                   "lam_1d": (ky, kx, lam[0])}[bad]
    with torch.no_grad(), pytest.raises(ValueError, match="expected ky"):
        ops.ssog_mix(v, (3, 4), ky, kx, lam)


def test_steered_backward_frees_the_values_while_the_output_lives_on():
    """What the steered mixing saves is freed by its backward, as for any op: nothing else in its autograd node (the
    geometry closure) may hold the values, or a model's backward keeps every block's values to the end (ViT-B at 384
    px: 12 x 1.69 MiB more at the step's peak, which is what happened)."""
    m = make_mixer(STEER_PATHS, dim=12, heads=3, atoms=2)
    x = torch.randn(2, 1 + 12, 12, **F64, requires_grad=True)
    values = x * 2.0  # a non-leaf that only the mixing's node keeps once the name is gone
    ref = weakref.ref(values)
    y = ops.ssog_mix_steered_by_tokens(values, (3, 4), x[:, 1:], m.mu, m.sigma(), m.ell, m.tau(), *m._steering(),
                                       steer=m.steer, radius=m.radius)
    del values
    assert ref() is not None  # saved for backward
    y.sum().backward()
    assert ref() is None and y.grad_fn is not None  # freed by backward, while y and its graph node still exist


def test_steered_geometry_is_recomputed_under_the_forwards_autocast(monkeypatch):
    """Backward runs outside the caller's ``torch.autocast`` block; the geometry it recomputes from the steering maps'
    outputs must be computed as in the forward (under the same autocast), or its gradients belong to another
    function."""
    m = make_mixer(STEER_PATHS, dim=12, heads=3, atoms=2).float()
    seen = []
    plain = ops._output_geometry

    def spy(*args, **kwargs):
        out = plain(*args, **kwargs)
        seen.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))
        return out

    monkeypatch.setattr(ops, "_output_geometry", spy)
    x = torch.randn(2, 1 + 12, 12, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, grid=(3, 4))
    y.float().sum().backward()
    assert seen == [(True, False), (True, True)]  # forward (no grad inside the function), backward's recompute
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_steered_layer_double_backward_through_the_recomputed_geometry():
    """A gradient penalty through the steered layer (create_graph=True): the geometry recomputed in backward joins
    the outer graph, checked numerically in float64 for the input and every parameter."""
    m = make_mixer(STEER_PATHS, dim=4, heads=2, atoms=2)
    names = [n for n, _ in m.named_parameters()]
    x = torch.randn(1, 1 + 2 * 3, 4, **F64, requires_grad=True)

    def f(x, *params):
        return torch.func.functional_call(m, dict(zip(names, params)), (x,), {"grid": (2, 3)})

    assert torch.autograd.gradgradcheck(f, (x, *[p.detach().requires_grad_() for p in m.parameters()]))


def test_functional_mixing_refuses_a_grid_or_geometry_that_does_not_fit():
    """The functions behind the layer refuse what the layer refuses, rather than reading patches as prefix tokens."""
    values = torch.randn(1, 1 + 12, 8)
    ky, kx, lam = torch.ones(2, 2, 3, 3) / 3, torch.ones(2, 2, 4, 4) / 4, torch.full((2, 2), 0.5)
    with pytest.raises(ValueError, match="does not fit the grid"):
        ops.ssog_mix(values, (3, 5), ky, kx, lam)
    with pytest.raises(ValueError, match="positive ints"):
        ops.ssog_mix(values, (3.0, 4), ky, kx, lam)
    mu, lam_t = torch.zeros(1, 12, 2, 2, 2), torch.full((1, 12, 2, 2), 0.5)
    with pytest.raises(ValueError, match="does not fit the grid"):
        ops.ssog_mix_steered(values, (3, 5), mu, mu + 1, lam_t, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"mu must have one row per patch token, shape \(B, N, \.\.\.\) = \(1, 12\)"):
        ops.ssog_mix_steered(values, (3, 4), mu[:, :6], mu + 1, lam_t, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"lam of shape \(B, N, H, R\), got \(1, 12, 2, 2, 2\), \(1, 12, 2, 2, 2\) and "
                                         r"\(1, 12, 2\)"):
        ops.ssog_mix_steered(values, (3, 4), mu, mu + 1, lam_t[..., 0], torch.tensor(1.0))
    with pytest.raises(ValueError, match="expected mu and sigma"):
        ops.ssog_mix_steered(values, (3, 4), mu, (mu + 1)[..., :1], lam_t, torch.tensor(1.0))
    with pytest.raises(ValueError, match="width 8 is not divisible by the geometry's 3 heads"):
        three = torch.zeros(1, 12, 3, 2, 2)
        ops.ssog_mix_steered(values, (3, 4), three, three + 1, torch.full((1, 12, 3, 2), 0.5), torch.tensor(1.0))
