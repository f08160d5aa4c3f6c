"""The analysis tools report what the paper's claims need: Lipschitz bound vs estimate, effective atoms, sinks,
steering statistics (docs/analysis.md)."""

from __future__ import annotations

import math

import pytest
import torch

from ssogvit.analysis import (
    atoms_report,
    effective_atoms,
    head_norm_bounds,
    high_norm_share,
    lipschitz_bound,
    lipschitz_estimate,
    local_lipschitz_growth,
    rollout,
    sink_metrics,
    sink_score,
    steering_stats,
)
from ssogvit.layers import create_mixer


def _random_fixed_mixer(gen: torch.Generator, *, heads: int, atoms: int, dim: int, identity_weights: bool):
    per_head = bool(torch.randint(2, (), generator=gen))
    m = create_mixer("ssog", dim, heads, num_atoms=atoms, per_head_temperature=per_head)
    with torch.no_grad():
        m.mu.copy_(torch.randn(m.mu.shape, generator=gen) * 4 * torch.rand((), generator=gen))
        m.rho.copy_(torch.randn(m.rho.shape, generator=gen) * 3)
        m.ell.copy_(torch.randn(m.ell.shape, generator=gen) * 3)
        m.theta.copy_(torch.randn(m.theta.shape, generator=gen) * 2)
        if identity_weights:  # the Jacobian is then the token mixing alone, where the bound is tightest
            m.v.weight.copy_(torch.eye(dim))
            m.proj.weight.copy_(torch.eye(dim))
    return m


# -- Lipschitz ------------------------------------------------------------------------------------------------------


def test_empirical_lipschitz_never_exceeds_the_bound_over_random_fixed_mixers():
    gen = torch.Generator().manual_seed(7)
    ratios = []
    for trial in range(24):
        heads = int(torch.randint(1, 4, (), generator=gen))
        dim = heads * int(torch.randint(1, 4, (), generator=gen))
        m = _random_fixed_mixer(gen, heads=heads, atoms=int(torch.randint(1, 5, (), generator=gen)), dim=dim,
                                identity_weights=trial % 2 == 0)
        grid = (int(torch.randint(1, 7, (), generator=gen)), int(torch.randint(1, 7, (), generator=gen)))
        prefix = int(torch.randint(0, 3, (), generator=gen))
        bound = lipschitz_bound(m, grid, prefix)
        est = lipschitz_estimate(m, grid, prefix, iters=40, seed=trial)
        assert math.isfinite(bound) and est > 0
        assert est <= bound * (1 + 1e-9), (trial, grid, prefix, est, bound)
        ratios.append(est / bound)
    # the bound is informative, not vacuous: with identity projections it is often nearly attained
    assert max(ratios) > 0.9


def _identity_like_mixer(*, num_atoms: int):
    """An SSoG mixer (D = 4, one head) whose field is centred and as sharp as it goes, with identity projections."""
    m = create_mixer("ssog", 4, 1, num_atoms=num_atoms, sigma_min=0.05, tau_min=0.05)
    with torch.no_grad():
        m.mu.zero_()
        m.rho.fill_(-30.0)
        m.theta.fill_(-30.0)
        m.v.weight.copy_(torch.eye(4))
        m.proj.weight.copy_(torch.eye(4))
    return m


def test_bound_is_attained_by_a_sharp_centred_field():
    # mu = 0 and the narrowest width make every axis kernel nearly the identity: ||A_h||_2 = 1 = the bound's factor
    m = _identity_like_mixer(num_atoms=2)
    bound = lipschitz_bound(m, (5, 4), 0)
    est = lipschitz_estimate(m, (5, 4), 0, iters=50)
    assert bound == pytest.approx(1.0, abs=1e-6)
    assert est == pytest.approx(1.0, abs=1e-6)


def test_prefix_tokens_raise_the_bound_and_the_estimate_by_sqrt_1_plus_p_over_n():
    # The pooled prefix outputs are extra outputs: for an identity-like field ||M_h|| = sqrt(1 + P/N), so a bound
    # that ignored them would be exceeded (docs/analysis.md, lipschitz).
    m = _identity_like_mixer(num_atoms=1)
    grid, prefix = (2, 2), 2
    expected = math.sqrt(1 + prefix / 4)
    assert lipschitz_bound(m, grid, prefix) == pytest.approx(expected, rel=1e-9)
    assert lipschitz_estimate(m, grid, prefix, iters=50) == pytest.approx(expected, rel=1e-6)


def test_bound_without_the_dense_matrix_equals_the_dense_computation():
    gen = torch.Generator().manual_seed(3)
    m = _random_fixed_mixer(gen, heads=3, atoms=4, dim=6, identity_weights=False).double()
    for grid, prefix in (((3, 5), 0), ((4, 2), 1), ((1, 6), 2)):
        x = torch.randn(1, prefix + grid[0] * grid[1], 6, dtype=torch.float64)
        attn = m.attention_matrix(x, grid, num_prefix_tokens=prefix)  # dense (1, H, T, T), ssogvit.reference
        dense = (attn[0].sum(-2).amax(-1) * attn[0].sum(-1).amax(-1)).sqrt()
        torch.testing.assert_close(head_norm_bounds(m, grid, prefix), dense, atol=1e-12, rtol=0)


@pytest.mark.parametrize("scale", [1e3, 1e6])
def test_bound_is_finite_for_extreme_parameters(scale):
    m = create_mixer("ssog", 8, 2, num_atoms=3)
    with torch.no_grad():
        m.mu.copy_(torch.tensor([scale, -scale, 0.0]).view(1, 3, 1).expand(2, 3, 2))
        m.rho.copy_(torch.tensor([scale, -scale, 0.0]).view(1, 3, 1).expand(2, 3, 2))
        m.ell.copy_(torch.tensor([[scale, -scale, 0.0], [0.0, 0.0, 0.0]]))
        m.theta.fill_(scale)
        m.v.weight.mul_(scale)
        m.proj.weight.mul_(1 / scale)
    for theta in (scale, -scale):
        with torch.no_grad():
            m.theta.fill_(theta)
        bound = lipschitz_bound(m, (3, 4), 1)
        assert math.isfinite(bound) and bound > 0
        assert lipschitz_estimate(m, (3, 4), 1, iters=20) <= bound * (1 + 1e-9)


def test_bound_refuses_centres_beyond_float64_accuracy():
    m = create_mixer("ssog", 8, 2, num_atoms=3)
    with torch.no_grad():
        m.mu[0, 1, 0] = 1e12
    with pytest.raises(ValueError, match="centre of 1e\\+12 grid cells is beyond 1e\\+09"):
        lipschitz_bound(m, (3, 4), 1)
    with torch.no_grad():
        m.mu[0, 1, 0] = 1e9
    assert math.isfinite(lipschitz_bound(m, (3, 4), 1))


def test_steered_local_constant_grows_with_the_input_norm_and_fixed_does_not():
    torch.manual_seed(0)
    steered = create_mixer("ssog-steered", 8, 2, num_atoms=2, gate_init=0.0)
    with torch.no_grad():
        for path in ("mu", "sigma", "lambda"):
            getattr(steered, f"{path}_steer").weight.normal_(0, 0.3)
    growth = local_lipschitz_growth(steered, (3, 3), 1, radii=[0.1, 8.0], samples=1, iters=15)
    assert growth[1]["local_max"] > 3 * growth[0]["local_max"]
    with pytest.raises(ValueError, match="fixed SSoG"):
        lipschitz_bound(steered, (3, 3), 1)
    fixed = create_mixer("ssog", 8, 2, num_atoms=2)
    flat = local_lipschitz_growth(fixed, (3, 3), 1, radii=[0.1, 8.0], samples=1, iters=40)
    bound = lipschitz_bound(fixed, (3, 3), 1)
    assert all(r["local_max"] <= bound * (1 + 1e-9) for r in flat)
    assert flat[1]["local_max"] == pytest.approx(flat[0]["local_max"], rel=1e-3)


# -- effective atoms ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 2, 4, 7])
def test_effective_atoms_is_r_for_uniform_and_1_for_one_hot(r):
    assert effective_atoms(torch.full((r,), 1.0 / r, dtype=torch.float64)).item() == pytest.approx(r, rel=1e-12)
    one_hot = torch.zeros(r)
    one_hot[r // 2] = 1.0
    assert effective_atoms(one_hot).item() == pytest.approx(1.0, abs=1e-12)


def test_atoms_report_reads_the_mixture_of_every_head():
    m = create_mixer("ssog", 8, 2, num_atoms=4)
    with torch.no_grad():
        m.ell[1].copy_(torch.tensor([50.0, 0.0, 0.0, 0.0]))  # head 0 uniform (ell = 0), head 1 one-hot

    class _Model(torch.nn.Module):
        family = "vit"

        def mixers(self):
            return [m]

    report = atoms_report(_Model())
    assert report["layers"][0]["per_head"] == pytest.approx([4.0, 1.0], abs=1e-6)
    assert report["mean"] == pytest.approx(2.5, abs=1e-6)


# -- attention sinks ------------------------------------------------------------------------------------------------


def _uniform(b, h, t):
    return torch.full((b, h, t, t), 1.0 / t, dtype=torch.float64)


def test_sink_metrics_are_1_on_a_uniform_map():
    maps = [_uniform(4, 3, 10) for _ in range(3)]
    s = sink_metrics(maps, num_prefix_tokens=1)
    assert s["sink_mean"] == pytest.approx(1.0) and s["sink_worst"] == pytest.approx(1.0)
    assert s["sink_rollout"] == pytest.approx(1.0)
    assert s["cls_mass"] == pytest.approx(0.1)


def test_sink_metrics_report_a_planted_sink():
    b, h, t, key = 6, 2, 10, 3
    gen = torch.Generator().manual_seed(0)
    noise = torch.softmax(torch.randn(b, h, t, t, generator=gen, dtype=torch.float64), -1)
    plant = torch.zeros(b, h, t, t, dtype=torch.float64)
    plant[..., key] = 1.0
    sink_layer = 0.5 * noise + 0.5 * plant  # every query sends half its attention to `key`
    maps = [_uniform(b, h, t), sink_layer, _uniform(b, h, t)]
    s = sink_metrics(maps, num_prefix_tokens=1)
    # key receives 0.5 + 0.5 * (its noise share) from each of the t queries; the uniform share is 1/t
    expected = (0.5 * t + 0.5 * noise[..., key].sum(-1)).mean(1)  # per image, heads averaged
    assert s["sink_per_layer"][1] == pytest.approx(expected.mean().item(), rel=1e-9)
    assert s["sink_worst"] > 0.5 * t and s["sink_worst_layer"] == 1
    assert s["sink_per_layer"][0] == pytest.approx(1.0) and s["sink_per_layer"][2] == pytest.approx(1.0)
    assert s["same_key_per_layer"][1] == 1.0
    assert s["sink_rollout"] > 1.5
    # the rollout is row-stochastic
    torch.testing.assert_close(rollout(maps).sum(-1), torch.ones(b, t, dtype=torch.float64))


def test_same_key_share_counts_images_agreeing_with_the_most_frequent_key():
    t = 5
    maps = []
    for key in (2, 2, 2, 4):  # three images sink into key 2, one into key 4
        a = torch.zeros(1, 1, t, t)
        a[..., key] = 1.0
        maps.append(a)
    s = sink_metrics([torch.cat(maps)], num_prefix_tokens=1)
    assert s["same_key"] == pytest.approx(0.75)
    assert s["sink_mean"] == pytest.approx(t)  # all attention on one key: t times the uniform share
    assert sink_score(torch.cat(maps)).tolist() == pytest.approx([t] * 4)


def test_high_norm_share_finds_tokens_above_three_times_the_median():
    tokens = torch.ones(2, 1 + 16, 4)
    tokens[0, 1 + 5] *= 10.0  # one outlier patch in image 0
    tokens[1, 0] *= 100.0  # the class token does not count
    assert high_norm_share(tokens, 1).tolist() == pytest.approx([1 / 16, 0.0])


# -- steering -------------------------------------------------------------------------------------------------------


class _OneMixerModel(torch.nn.Module):
    """The smallest thing `steering_stats` reads: `mixers()` and `forward_features` calling the mixer once."""

    family = "vit"

    def __init__(self, mixer, grid):
        super().__init__()
        self.mixer, self.grid = mixer, grid

    def mixers(self):
        return [self.mixer]

    def forward_features(self, x):
        return self.mixer(x, grid=self.grid)


def test_steering_stats_cold_start_barely_moves_and_shifts_stay_within_the_effective_radius():
    torch.manual_seed(0)
    mixer = create_mixer("ssog-steered", 8, 2, num_atoms=3, radius=4.0)
    x = torch.randn(5, 1 + 12, 8)
    cold = steering_stats(_OneMixerModel(mixer, (3, 4)), x)["mixers"][0]
    assert cold["mean_delta_mu"] == 0.0  # zero-initialised steering maps: no shift at all
    assert cold["effective_radius"] == pytest.approx(4.0 * (math.log1p(math.exp(-8.0)) + 1e-4))
    with torch.no_grad():
        mixer.alpha_mu.fill_(1.0)
        mixer.mu_steer.weight.normal_(0, 1.0)
    warm = steering_stats(_OneMixerModel(mixer, (3, 4)), x)["mixers"][0]
    radius = 4.0 * (math.log1p(math.e) + 1e-4)
    assert warm["effective_radius"] == pytest.approx(radius)
    assert 0.05 * radius < warm["mean_delta_mu"] <= warm["max_delta_mu"] <= radius * (1 + 1e-6)
    assert warm["gates"]["mu"] == pytest.approx(math.log1p(math.e) + 1e-4)
