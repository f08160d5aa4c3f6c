"""The analytic FLOP count reproduces the paper's Table 4 and agrees with torch's FlopCounterMode."""

import pytest
import torch

from ssogvit.backends import cpu
from ssogvit.bench import count_flops, flops_breakdown, measure_flops, mixer_flops
from ssogvit.bench.flops import TABLE4_ATTENTION, TABLE4_TOTAL
from ssogvit.layers import create_mixer
from ssogvit.models import create_model


@pytest.fixture(scope="module")
def base_models():
    torch.manual_seed(0)
    return {
        (family, mixer): create_model(f"{family}-base-{mixer}", num_classes=1000)
        for family in ("vit", "looped", "ode")
        for mixer in ("mha", "ssog")
    }


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
@pytest.mark.parametrize("mixer", ["mha", "ssog"])
def test_count_flops_reproduces_paper_table4_within_1_5_percent(base_models, family, mixer):
    model = base_models[(family, mixer)]
    for res, paper in TABLE4_TOTAL[mixer].items():
        assert count_flops(model, res) / 1e9 == pytest.approx(paper, rel=0.015), (family, mixer, res)
    for res, paper in TABLE4_ATTENTION[mixer].items():
        assert flops_breakdown(model, res)["mixer"] / 1e9 == pytest.approx(paper, rel=0.015), (family, mixer, res)


def test_breakdown_parts_add_up_and_ssog_saves_exactly_the_qk_projections_and_the_score_matrix(base_models):
    res, t, n, d, r, g = 384, 577, 576, 768, 4, 24
    mha = flops_breakdown(base_models[("vit", "mha")], res)
    ssog = flops_breakdown(base_models[("vit", "ssog")], res)
    for parts in (mha, ssog):
        assert parts["total"] == parts["patch_embed"] + parts["mixer"] + parts["mlp"] + parts["head"]
    assert mha["mlp"] == ssog["mlp"] == 12 * 2 * 8 * t * d * d
    assert mha["mixer"] == 12 * 2 * (4 * t * d * d + 2 * t * t * d)
    assert ssog["mixer"] == 12 * 2 * ((n + t) * d * d + r * d * n * 2 * g + n * d)


def _small_models():
    for family in ("vit", "looped", "ode"):
        for mixer in ("mha", "mha-unfused", "ssog", "ssog-steered"):
            yield f"{family}-tiny-{mixer}"


@pytest.mark.parametrize("name", list(_small_models()))
def test_flop_counter_mode_agrees_within_2_percent(name):
    torch.manual_seed(0)
    model = create_model(name, img_size=96, depth=2, num_classes=10)
    analytic, measured = count_flops(model, 96), measure_flops(model, 96)
    assert measured > 0
    assert measured == pytest.approx(analytic, rel=0.02)


@pytest.mark.parametrize("name", ["mha", "mha-unfused", "ssog", "ssog-steered", "torch-mha"])
def test_mixer_flops_match_flop_counter_mode_on_a_rectangular_grid(name):
    from torch.utils.flop_counter import FlopCounterMode

    from ssogvit.bench.flops import _custom_mapping

    dim, heads, grid, prefix = 96, 4, (5, 7), 2
    if name == "torch-mha":
        mixer = torch.nn.MultiheadAttention(dim, heads, batch_first=True).eval()
    else:
        mixer = create_mixer(name, dim, heads).eval()
    x = torch.randn(1, prefix + grid[0] * grid[1], dim)
    # the torch path, whose matmuls the counter sees (the C kernel of backends.cpu does the same multiply-adds)
    with torch.no_grad(), cpu.enabled(False), FlopCounterMode(display=False,
                                                             custom_mapping=_custom_mapping()) as counter:
        mixer(x, x, x, need_weights=False) if name == "torch-mha" else mixer(x, grid=grid, num_prefix_tokens=prefix)
    assert counter.get_total_flops() == pytest.approx(mixer_flops(mixer, grid, prefix)["total"], rel=0.02)


def test_core_read_counts_the_band_entries_where_the_kernel_takes_them_and_whole_rows_elsewhere():
    """``core_read`` (issue 34): SSoG's core over the kernel entries the C kernel reads. Narrow atoms on a large grid
    read their bands (``core.field_bands``' lengths, every x-row once per query row and every y-row once per query
    column); atoms as wide as the grid read whole rows, the definition's count; attention reads what it defines."""
    from ssogvit import core

    grid, prefix, dim, heads = (40, 24), 1, 32, 4
    narrow = create_mixer("ssog", dim, heads).eval()
    with torch.no_grad():
        narrow.rho.fill_(-3.0)
    wide = create_mixer("ssog", dim, heads, rho_init=8.0).eval()
    f_narrow, f_wide = mixer_flops(narrow, grid, prefix), mixer_flops(wide, grid, prefix)
    assert f_wide["core_read"] == f_wide["core"]
    scale = core.kernel_scale(narrow.sigma(), narrow.tau()).detach()
    by, bx = (b[..., 1] - b[..., 0] for b in core.field_bands(narrow.mu.detach(), scale, grid, torch.float32))
    n = grid[0] * grid[1]
    want = 2 * (dim // heads * (grid[1] * int(by.sum()) + grid[0] * int(bx.sum())) + prefix * n * dim)
    assert f_narrow["core_read"] == want < f_narrow["core"] / 4
    mha = mixer_flops(create_mixer("mha", dim, heads), grid, prefix)
    assert mha["core_read"] == mha["core"]
