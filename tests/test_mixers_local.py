"""The attention mixers users pick at high resolution (docs/models.md, "Local attention mixers"): window (plain and
shifted), neighbourhood and linear attention, each against its dense float64 definition, forward and backward."""

import subprocess
import sys
import warnings

import pytest
import timm
import torch

from ssogvit import reference
from ssogvit.bench.flops import mixer_flops
from ssogvit.layers import (
    LinearAttention,
    NeighborhoodAttention,
    WindowAttention,
    create_mixer,
    list_mixers,
    mixer_options,
)
from ssogvit.models import create_model, timm_name

DIM, HEADS = 16, 2
#: (grid, prefix tokens): rectangular, not divisible by the window, no prefix, several prefix tokens, smaller than
#: the window or kernel along both axes
GRIDS = [((6, 10), 1), ((5, 7), 2), ((8, 8), 0), ((2, 3), 1)]
CONFIGS = [
    ("window", dict(window_size=4)),
    ("window", dict(window_size=4, shift_size=2)),
    ("window", dict(window_size=3, shift_size=1)),
    ("neighborhood", dict(kernel_size=3)),
    ("neighborhood", dict(kernel_size=5)),
    ("linear", {}),
]


def _ids(configs):
    return [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in configs]


# -- the dense patterns against their definitions, cell by cell ----------------------------------------------------


def _window_by_cells(grid, window, shift, p):
    """Swin's shifted windows written out: the tiling by ``window`` cells starts ``shift`` cells before the grid."""
    gh, gw = grid
    (wh, ww), (sh, sw) = window, shift
    cells = [(y, x) for y in range(gh) for x in range(gw)]
    t = p + len(cells)
    mask = torch.ones(t, t, dtype=torch.bool)
    for i, (y, x) in enumerate(cells):
        for j, (yy, xx) in enumerate(cells):
            mask[p + i, p + j] = ((y + wh - sh) // wh == (yy + wh - sh) // wh
                                  and (x + ww - sw) // ww == (xx + ww - sw) // ww)
    return mask


def _neighborhood_by_cells(grid, k, p):
    """NATTEN's neighbourhood written out: the k x k window around the query, moved inside the grid."""
    gh, gw = grid
    cells = [(y, x) for y in range(gh) for x in range(gw)]
    t = p + len(cells)
    mask = torch.ones(t, t, dtype=torch.bool)
    kh, kw = min(k, gh), min(k, gw)
    for i, (y, x) in enumerate(cells):
        sy, sx = min(max(y - kh // 2, 0), gh - kh), min(max(x - kw // 2, 0), gw - kw)
        for j, (yy, xx) in enumerate(cells):
            mask[p + i, p + j] = sy <= yy < sy + kh and sx <= xx < sx + kw
    return mask


@pytest.mark.parametrize(("grid", "p"), [((6, 10), 1), ((7, 5), 0)])
def test_reference_patterns_are_their_definitions(grid, p):
    for w, s in [(4, 0), (4, 2), (3, 1), (2, 1)]:
        assert torch.equal(reference.window_mask(grid, (w, w), (s, s), num_prefix=p),
                           _window_by_cells(grid, (w, w), (s, s), p))
    for k in (1, 3, 5):
        assert torch.equal(reference.neighborhood_mask(grid, (k, k), num_prefix=p), _neighborhood_by_cells(grid, k, p))
    # every patch sees exactly k * k patches, and the prefix tokens; prefix tokens see everything
    m = reference.neighborhood_mask(grid, (3, 3), num_prefix=p)
    assert (m[p:, p:].sum(-1) == 9).all() and m[:, :p].all() and m[:p].all()


def test_the_mixers_own_patterns_follow_swins_rule_on_short_axes():
    # an axis no longer than the window is one window, unshifted; a shorter axis than the kernel is seen whole
    w = WindowAttention(DIM, HEADS, window_size=4, shift_size=2)
    assert w.windows((3, 10)) == ((3, 4), (0, 2))
    assert torch.equal(w.mask((3, 10), 1), reference.window_mask((3, 10), (3, 4), (0, 2), num_prefix=1))
    n = NeighborhoodAttention(DIM, HEADS, kernel_size=5)
    assert n.kernel((3, 10)) == (3, 5)


# -- fast paths against the dense definition, float64, forward and backward ----------------------------------------


def _dense(mixer, x, grid, p):
    """The mixer's output through its dense matrix (``attention_matrix``, from ``ssogvit.reference``)."""
    a = mixer.attention_matrix(x, grid, num_prefix_tokens=p)
    _, _, v = mixer._qkv(x, None, None)
    return mixer._output(a @ v)


def _dense_by_hand(mixer, x, grid, p):
    """The same, the matrix written from the test's own patterns (independent of the mixer's ``mask``)."""
    q, k, v = mixer._qkv(x, None, None)
    if isinstance(mixer, LinearAttention):
        phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        a = phi_q @ phi_k.transpose(-2, -1)
        a = a / a.sum(-1, keepdim=True)
    else:
        if isinstance(mixer, WindowAttention):
            mask = _window_by_cells(grid, *mixer.windows(grid), p)
        else:
            mask = _neighborhood_by_cells(grid, mixer.kernel_size, p)
        logits = (q @ k.transpose(-2, -1)) * mixer.scale
        a = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return mixer._output(a @ v)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=_ids(CONFIGS))
@pytest.mark.parametrize(("grid", "p"), GRIDS, ids=[f"{g[0]}x{g[1]}+{p}" for g, p in GRIDS])
def test_fast_path_equals_the_dense_definition_forward_and_backward(name, options, grid, p):
    mixer = create_mixer(name, DIM, HEADS, **options).double()
    x = torch.randn(2, p + grid[0] * grid[1], DIM, dtype=torch.float64, requires_grad=True)
    y = mixer(x, grid, num_prefix_tokens=p)
    dense = _dense(mixer, x, grid, p)
    torch.testing.assert_close(y, dense, atol=1e-12, rtol=0)
    torch.testing.assert_close(y, _dense_by_hand(mixer, x, grid, p), atol=1e-12, rtol=0)
    g = torch.randn_like(y)
    fast = torch.autograd.grad(y, [x, *mixer.parameters()], g)
    slow = torch.autograd.grad(dense, [x, *mixer.parameters()], g)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=_ids(CONFIGS))
def test_float32_agrees_with_float64(name, options):
    mixer = create_mixer(name, DIM, HEADS, **options)
    x = torch.randn(2, 1 + 60, DIM)
    y = mixer(x, (6, 10))
    torch.testing.assert_close(y.double(), mixer.double()(x.double(), (6, 10)), atol=2e-6, rtol=0)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=_ids(CONFIGS))
def test_every_parameter_gets_a_finite_nonzero_gradient(name, options):
    mixer = create_mixer(name, DIM, HEADS, **options)
    x = torch.randn(2, 1 + 35, DIM, requires_grad=True)
    mixer(x, (5, 7)).square().sum().backward()
    for n, param in [("x", x), *mixer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, n


def test_window_attention_is_dense_attention_when_one_window_covers_the_grid():
    mha = create_mixer("mha", DIM, HEADS).double()
    win = create_mixer("window", DIM, HEADS, window_size=8).double()
    win.load_state_dict(mha.state_dict())  # timm's parameter names: the same weights
    x = torch.randn(2, 1 + 24, DIM, dtype=torch.float64)
    torch.testing.assert_close(win(x, (4, 6)), mha(x, (4, 6)), atol=1e-12, rtol=0)


def test_patches_are_mixed_only_within_their_window_and_prefix_tokens_globally():
    win = create_mixer("window", DIM, HEADS, window_size=2).double()
    x = torch.randn(1, 1 + 16, DIM, dtype=torch.float64)
    y = win(x, (4, 4))
    x2 = x.clone()
    x2[0, 1 + 15] += 1.0  # the last patch, in the bottom-right window (patches 10, 11, 14, 15)
    changed = (win(x2, (4, 4)) - y).abs().amax(-1)[0] > 1e-12
    assert changed.nonzero().flatten().tolist() == [0, 1 + 10, 1 + 11, 1 + 14, 1 + 15]


def test_neighborhood_flex_attention_equals_the_tiled_path():
    from ssogvit.layers import neighborhood as nb

    mixer = create_mixer("neighborhood", DIM, HEADS, kernel_size=3).double()
    x = torch.randn(2, 1 + 60, DIM, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused: the mask is what is tested
        q, k, v = mixer._qkv(x, None, None)
        block_mask = nb._block_mask((6, 10), 1, mixer.kernel((6, 10)), "cpu")
        flex = mixer._output(nb._flex_attention(compiled=False)(q, k, v, block_mask=block_mask))
        torch.testing.assert_close(flex, mixer(x, (6, 10)), atol=1e-12, rtol=0)


def test_neighborhood_impl_choice_says_where_flex_runs():
    auto = NeighborhoodAttention(DIM, HEADS)
    assert not auto.uses_flex(torch.device("cpu"))  # eager CPU: tiled
    assert auto.uses_flex(torch.device("cuda")) and not auto.uses_flex(torch.device("cuda"), drop=0.1)
    assert NeighborhoodAttention(DIM, HEADS, impl="tiled").uses_flex(torch.device("cuda")) is False
    flex = NeighborhoodAttention(DIM, HEADS, impl="flex", kernel_size=3)
    with pytest.raises(ValueError, match="no backward on CPU"):
        flex(torch.randn(1, 1 + 16, DIM, requires_grad=True), (4, 4))


@pytest.mark.slow
def test_neighborhood_compiled_flex_attention_equals_the_dense_definition():
    mixer = create_mixer("neighborhood", DIM, HEADS, kernel_size=3, impl="flex").eval()
    x = torch.randn(2, 1 + 60, DIM)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x, (6, 10)), _dense(mixer, x, (6, 10), 1), atol=1e-5, rtol=0)


def test_linear_attention_is_the_normalised_kernel_matrix_in_half_precision_too():
    mixer = create_mixer("linear", DIM, HEADS)
    x = torch.randn(1, 1 + 64, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(x, (8, 8))
    torch.testing.assert_close(y.float(), _dense(mixer, x, (8, 8), 1), atol=3e-2, rtol=0)
    a = mixer.attention_matrix(x, (8, 8))
    torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5, rtol=0)
    assert (a > 0).all()


# -- FLOPs --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "options"), [("window", dict(window_size=4)), ("window", dict(window_size=4,
                                                                                                 shift_size=2)),
                                               ("linear", {})])
def test_flops_match_flop_counter_mode(name, options):
    from torch.utils.flop_counter import FlopCounterMode

    from ssogvit.bench.flops import _custom_mapping

    mixer, grid, p = create_mixer(name, 32, 2, **options).eval(), (8, 12), 1
    x = torch.randn(1, p + 96, 32)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_custom_mapping()) as counter:
        mixer(x, grid, num_prefix_tokens=p)
    # linear attention's normaliser is a matrix-vector product the counter sees; the feature map is not counted
    assert counter.get_total_flops() == pytest.approx(mixer_flops(mixer, grid, p)["total"], rel=0.01)


def test_neighborhood_flops_count_the_definition_and_the_tiled_path_does_at_most_twice_the_core():
    from torch.utils.flop_counter import FlopCounterMode

    from ssogvit.bench.flops import _custom_mapping

    mixer, grid, p = create_mixer("neighborhood", 32, 2, kernel_size=7).eval(), (16, 16), 1
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_custom_mapping()) as counter:
        mixer(torch.randn(1, p + 256, 32), grid, num_prefix_tokens=p)
    f = mixer_flops(mixer, grid, p)
    assert f["core"] == 2 * (2 * 256 * (49 + p) * 32 + 2 * p * (256 + p) * 32)
    assert f["core"] < counter.get_total_flops() - f["projections"] <= 2.2 * f["core"]


def test_window_flops_grow_with_the_window_and_not_with_the_square_of_the_tokens():
    win = create_mixer("window", 384, 6, window_size=16)
    small, large = (mixer_flops(win, (g, g), 1)["core"] for g in (64, 128))
    assert large == pytest.approx(4 * small, rel=0.01)
    mha = create_mixer("mha", 384, 6)
    assert mixer_flops(mha, (128, 128), 1)["core"] > 60 * large


# -- in every family, the registry, timm -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
@pytest.mark.parametrize("mixer", ["window", "neighborhood", "linear"])
def test_every_family_builds_and_trains_with_each_mixer(family, mixer):
    options = {"window": dict(window_size=3, shift_size=1), "neighborhood": dict(kernel_size=3), "linear": {}}[mixer]
    model = create_model(f"{family}-tiny-{mixer}", img_size=32, patch_size=8, depth=2, num_classes=5, **options)
    x = torch.randn(2, 3, 32, 48)  # a 4 x 6 grid, not a multiple of the window
    out = model(x)
    out.sum().backward()
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    again = create_model(**model.config)
    assert [type(m) for m in again.mixers()] == [type(m) for m in model.mixers()]
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in model.parameters())


def test_registry_and_timm_know_the_mixers():
    assert {"window", "neighborhood", "linear"} <= set(list_mixers())
    assert {"window_size", "shift_size"} <= set(mixer_options("window"))
    assert {"kernel_size", "impl"} <= set(mixer_options("neighborhood"))
    assert "attn_drop" not in mixer_options("linear") and "fused" not in mixer_options("window")
    model = timm.create_model(timm_name("vit-tiny-window"), img_size=32, patch_size=8, depth=1, num_classes=3,
                              window_size=2)
    assert isinstance(model.blocks[0].attn, WindowAttention) and model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize("mixer", ["window", "neighborhood", "linear"])
def test_a_dense_vits_weights_load_and_recorded_maps_are_the_mixers_own(mixer):
    from ssogvit.models import record_attention

    kw = dict(img_size=32, patch_size=8, depth=2, num_classes=3)
    model = create_model(f"vit-tiny-{mixer}", **kw, **({"window_size": 2} if mixer == "window" else
                                                        {"kernel_size": 3} if mixer == "neighborhood" else {}))
    model.load_state_dict(create_model("vit-tiny-mha", **kw).state_dict())  # strict: timm's names and shapes
    x = torch.randn(1, 3, 32, 32)
    with record_attention(model) as maps:
        model(x)
    assert len(maps) == 2 and all(torch.allclose(a.sum(-1), torch.ones(())) for a in maps)
    if mixer != "linear":
        assert torch.equal(maps[0][0, 0] > 0, model.blocks[0].attn.mask((4, 4), 1))


def test_vitdet_global_blocks():
    model = create_model("vit-tiny-window", img_size=32, patch_size=8, depth=4, num_classes=3, window_size=2,
                         global_blocks=(3, 1))
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["WindowAttention", "Attention", "WindowAttention", "Attention"]
    assert model.config["global_blocks"] == [1, 3]
    assert [type(b.attn).__name__ for b in create_model(**model.config).blocks] == kinds
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize(("build", "match"), [
    (lambda: create_mixer("window", DIM, HEADS, window_size=0), "window_size=0: expected an integer in"),
    (lambda: create_mixer("window", DIM, HEADS, window_size=4, shift_size=4), "shift_size=4: expected 0 <="),
    (lambda: create_mixer("window", DIM, HEADS, window_size=2.5), "window_size=2.5"),
    (lambda: create_mixer("neighborhood", DIM, HEADS, kernel_size=4), "kernel_size=4: expected an odd"),
    (lambda: create_mixer("neighborhood", DIM, HEADS, impl="natten"), "impl='natten'"),
    (lambda: create_mixer("neighborhood", DIM, HEADS, impl="flex", attn_drop=0.1), "no attention dropout"),
    (lambda: create_mixer("linear", DIM, HEADS, attn_drop=0.1), "does not take option"),
    (lambda: create_mixer("window", DIM, 3), "divisible"),
    (lambda: create_model("vit-tiny-window", depth=2, global_blocks=(2,)), "the model has 2 blocks"),
    (lambda: create_model("vit-tiny-window", depth=2, global_blocks=(1, 1)), "appears twice"),
    (lambda: create_model("looped-tiny-window", depth=2, global_blocks=(1,)), "unknown option 'global_blocks'"),
])
def test_bad_options_are_refused_with_a_clear_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("name", ["window", "neighborhood"])
def test_local_mixers_need_a_grid_that_fits_the_tokens(name):
    mixer = create_mixer(name, DIM, HEADS)
    x = torch.randn(1, 1 + 16, DIM)
    with pytest.raises(ValueError, match="needs the patch grid"):
        mixer(x)
    with pytest.raises(ValueError, match="does not fit the grid"):
        mixer(x, (4, 5), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="expects x of shape"):
        mixer(torch.randn(17, DIM), (4, 4))


# -- through the command line -------------------------------------------------------------------------------------


def _bench(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "ssogvit", "bench", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


@pytest.mark.slow
def test_bench_operator_and_models_run_the_new_mixers_in_both_modes(tmp_path):
    import csv

    proc = _bench("operator", "--mixers", "window:window_size=4", "neighborhood", "linear", "--res", "64",
                  "--batch", "1", "--dim", "32", "--heads", "2", "--warmup", "0", "--iters", "1", "--blocks", "1",
                  "--threads", "1", "--mode", "inference", "train", "--no-memory", "--no-plots", "--out", "op",
                  tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "op" / "operator.csv").open()))
    assert sorted((r["label"], r["mode"]) for r in rows) == sorted(
        (m, mode) for m in ("window[window_size=4]", "neighborhood", "linear") for mode in ("inference", "train"))
    assert all(r["status"] == "ok" and float(r["time_ms"]) > 0 and float(r["gflops_per_image"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_refuses_a_mixer_option_before_running_anything(tmp_path):
    for args in (["operator", "--mixers", "window:window_size=0"],
                 ["models", "--families", "vit", "--sizes", "tiny", "--mixers", "neighborhood", "--set",
                  "kernel_size=4"]):
        proc = _bench(*args, "--res", "64", "--out", "out", tmp_path=tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[-1].startswith("ssogvit bench") and "does not build" in lines[-1], proc.stderr
        assert not (tmp_path / "out").exists()
