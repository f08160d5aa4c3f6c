"""The three model families (docs/models.md) and the paper's claims about them."""

import pytest
import timm
import torch
import torch.nn.functional as F

from ssogvit.layers import default_pool, list_mixers
from ssogvit.models import (
    SIZES,
    CenterNorm,
    ODEViT,
    VisionTransformer,
    create_model,
    list_models,
    parse_model_name,
    record_attention,
    timm_name,
)

FAMILIES = ("vit", "looped", "ode")
MIXERS = ("mha", "mha-unfused", "ssog", "ssog-steered")
TINY = dict(img_size=32, patch_size=8, depth=2, num_classes=10)  # D=192, 4x4 grid: fast on 2 CPU cores


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models on a shared 2-core machine: one intra-op thread is ~100x faster than two contending ones.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def n_params(module):
    return sum(p.numel() for p in module.parameters())


def meta_model(name, **kw):
    """Build on the meta device: shapes and counts without memory or init cost."""
    with torch.device("meta"):
        return create_model(name, **kw)


def open_steering(model, gate=0.0, std=0.05):
    """Open every steering gate and give the zero-initialised steering maps non-zero weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".alpha_" in name:
                p.fill_(gate)
            elif "_steer." in name:
                p.normal_(0.0, std)
    return model


# -- names, registry, options -------------------------------------------------------------------------------------


def test_list_models_covers_every_family_size_and_mixer():
    names = list_models()
    assert len(names) == len(FAMILIES) * len(SIZES) * len(list_mixers()) == 105
    assert {parse_model_name(n) for n in names} == {(f, s, m) for f in FAMILIES for s in SIZES for m in list_mixers()}
    assert list_models("vit-*-ssog*") == [f"vit-{s}-{m}" for s in SIZES for m in ("ssog", "ssog-steered")]


def test_timm_create_model_builds_the_registered_models():
    from ssogvit.timm_compat import SSOGIFIED  # what ssogify's save_pretrained names

    pyramids = {timm_name(n) + "_pyramid" for n in list_models()}  # features only (docs/dense.md)
    assert set(timm.list_models("ssogvit_*")) == {timm_name(n) for n in list_models()} | pyramids | {SSOGIFIED}
    model = timm.create_model("ssogvit_looped_tiny_ssog_steered", **TINY)
    assert type(model).__name__ == "LoopedViT" and model.mixer_name == "ssog-steered"
    assert model.config["name"] == "looped-tiny-ssog-steered" and model.num_classes == 10
    with pytest.raises(ValueError, match="pretrained"):
        timm.create_model("ssogvit_vit_tiny_ssog", pretrained=True, **TINY)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("vit-tiny-ssog", {"foo": 1}, "'foo'.*not a known option"),
        ("vit-tiny-ssog", {"solver": "rk4"}, "'solver'.*ode family"),
        ("vit-tiny-mha", {"num_atoms": 4}, "'num_atoms'"),  # MHA has no atoms
        ("vit-huge-ssog", {}, "unknown size 'huge'"),
        ("vit-tiny-gauss", {}, "unknown mixer 'gauss'"),
        ("resnet-tiny-ssog", {}, "unknown family 'resnet'"),
        ("vit_tiny_ssog", {}, "not '{family}-{size}-{mixer}'"),
        ("ode-tiny-ssog", {"solver": "leapfrog"}, "unknown solver 'leapfrog'"),
        ("ode-tiny-ssog", {"norm": "batchnorm"}, "unknown norm 'batchnorm'"),
        ("ode-tiny-ssog", {"drop_path_rate": 0.1}, "drop_path_rate"),
        ("vit-tiny-ssog-steered", {"steer": ("mu", "depth")}, "steering path"),
    ],
)
def test_unknown_names_and_options_are_value_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_model(name, **{**TINY, **kwargs})


def test_model_classes_take_keyword_arguments_only():
    with pytest.raises(TypeError):
        VisionTransformer(192, 3)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("vit-tiny-ssog-steered", {"steer": ("mu", "lambda"), "radius": 2.0, "num_atoms": 3, "num_registers": 2}),
        ("looped-tiny-mha-unfused", {"drop_path_rate": 0.1}),
        ("ode-tiny-ssog", {"solver": "rk4", "norm": "centernorm", "scale": 3.0, "num_atoms": 2}),
    ],
)
def test_config_rebuilds_the_model(name, kwargs):
    model = create_model(name, **{**TINY, **kwargs}).eval()
    twin = create_model(**model.config).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    assert twin.config == model.config


# -- parameter counts (docs/models.md) ----------------------------------------------------------------------------


@pytest.mark.parametrize("size, timm_arch", [("small", "vit_small_patch16_224"), ("base", "vit_base_patch16_224")])
def test_discrete_mha_is_timm_vit_exactly(size, timm_arch):
    ours = meta_model(f"vit-{size}-mha", num_classes=100)
    with torch.device("meta"):
        ref = timm.create_model(timm_arch, num_classes=100)
    assert n_params(ours) == n_params(ref)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("mixer", ["mha", "mha-unfused"])
def test_discrete_mha_computes_what_timm_vit_computes(mixer):
    ref = timm.models.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10, drop_path_rate=0.0
    ).double().eval()
    ours = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10, mixer=mixer
    ).double().eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-12)


# (name, paper's count in millions, docs/models.md / the paper's Tables 10, 12): within 0.5%
PAPER_COUNTS = [
    ("vit-small-mha", 21.69),
    ("vit-medium-mha", 48.47),
    ("vit-base-mha", 85.86),
    ("vit-base-ssog", 71.6),
    ("looped-base-mha", 7.9),
    ("looped-base-ssog", 6.7),
]


@pytest.mark.parametrize("name, paper_millions", PAPER_COUNTS)
def test_parameter_count_matches_the_paper(name, paper_millions):
    count = n_params(meta_model(name, num_classes=100))
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.005, (name, count)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["small", "medium", "base"])
def test_ssog_saves_query_and_key_and_adds_5HR_plus_1_per_block(family, size):
    dim, heads, _ = SIZES[size]
    mha = meta_model(f"{family}-{size}-mha", num_classes=100)
    ssog = meta_model(f"{family}-{size}-ssog", num_classes=100)
    per_block = (2 * dim * dim + 2 * dim) - (5 * heads * 4 + 1)
    assert n_params(mha) - n_params(ssog) == len(mha.mixers()) * per_block  # one mixer per distinct block


@pytest.mark.parametrize(
    "size, paper_mha, paper_ssog", [("small", 3.07, 2.8), ("medium", 6.59, 5.9), ("base", 11.45, 10.3)]
)
def test_continuous_mha_minus_ssog_is_the_papers_difference(size, paper_mha, paper_ssog):
    # The paper prints MHA counts to 0.01M and SSoG counts to 0.1M, so its difference is known to about +-0.055M.
    mha = n_params(meta_model(f"ode-{size}-mha", num_classes=100))
    diff = (mha - n_params(meta_model(f"ode-{size}-ssog", num_classes=100))) / 1e6
    paper = paper_mha - paper_ssog
    assert abs(diff - paper) <= 0.005 + 0.05, (size, diff, paper)


@pytest.mark.parametrize(
    "size, paper_mha, paper_ssog", [("small", 3.07, 2.8), ("medium", 6.59, 5.9), ("base", 11.45, 10.3)]
)
def test_continuous_counts_are_6D2_below_the_papers(size, paper_mha, paper_ssog):
    """docs/models.md: the paper's continuous counts exceed ours by 6 D^2 for both mixers, up to its printed rounding
    and a few width-D vectors (biases, norms: 10 D allowed), which the rounding cannot resolve."""
    dim = SIZES[size][0]
    for mixer, paper, rounding in (("mha", paper_mha, 0.005e6), ("ssog", paper_ssog, 0.05e6)):
        gap = paper * 1e6 - n_params(meta_model(f"ode-{size}-{mixer}", num_classes=100))
        assert abs(gap - 6 * dim * dim) <= rounding + 10 * dim, (size, mixer, gap / dim**2)


@pytest.mark.parametrize("mixer", ["mha", "ssog", "ssog-steered"])
def test_looped_parameter_count_does_not_depend_on_T(mixer):
    counts = {t: n_params(meta_model(f"looped-small-{mixer}", num_classes=100, depth=t)) for t in (1, 6, 12, 24)}
    assert len(set(counts.values())) == 1
    model = meta_model(f"looped-small-{mixer}", num_classes=100)
    assert len(model.blocks) == 12 and len(model.mixers()) == 1  # timm sees T applications of one block
    # one block plus embeddings and head: the discrete model with a single block
    assert counts[12] == n_params(meta_model(f"vit-small-{mixer}", num_classes=100, depth=1))


# -- the continuous family ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixer", ["mha", "ssog-steered"])
@pytest.mark.parametrize("norm", ["layernorm", "centernorm"])
def test_euler_ode_equals_explicit_residual_loop(mixer, norm):
    n = 3
    model = open_steering(create_model(f"ode-tiny-{mixer}", **{**TINY, "depth": n, "norm": norm})).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    out = model.forward_features(x, pre_norm=True)
    assert model.nfe == n
    z, grid = model.embed(x)
    block = model.blocks.block  # the one block of the flow
    for _ in range(n):  # z <- z + (1/n) f(z), f(z) = s (Mixer(N1 z) + MLP(N2 z)), s = n
        f = model.scale * (block.attn(block.norm1(z), grid=grid) + block.mlp(block.norm2(z)))
        z = z + (1.0 / n) * f
    assert model.scale == n
    torch.testing.assert_close(out, z, rtol=0, atol=1e-12)
    assert (out - model.embed(x)[0]).abs().max() > 1e-3  # the field moved the tokens


def _small_ode(**kw):
    """A narrow ODE-ViT (D=24) in float64: solver tests need many evaluations, not width."""
    opts = dict(embed_dim=24, num_heads=2, mixer="mha", img_size=32, patch_size=8, num_classes=10, scale=1.0)
    return ODEViT(**{**opts, **kw}).double()


def test_solvers_converge_at_their_order_and_count_their_evaluations():
    base = _small_ode(solver="rk4", depth=32).eval().requires_grad_(False)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    ref = base.forward_features(x, pre_norm=True)
    assert base.nfe == 4 * 32
    assert (ref - base.embed(x)[0]).abs().max() > 0.1  # the field moves the tokens

    def error(solver, depth, **kw):
        model = _small_ode(solver=solver, depth=depth, **kw).eval().requires_grad_(False)
        model.load_state_dict(base.state_dict())
        out = model.forward_features(x, pre_norm=True)
        return float((out - ref).abs().max()), model.nfe

    (e8, n8), (e16, n16) = error("euler", 8), error("euler", 16)
    assert (n8, n16) == (8, 16) and 1.6 < e8 / e16 < 2.5  # first order
    (m8, n8), (m16, n16) = error("midpoint", 8), error("midpoint", 16)
    assert (n8, n16) == (16, 32) and 3.0 < m8 / m16 < 5.5  # second order
    err, nfe = error("dopri5", 12, rtol=1e-9, atol=1e-9)
    assert err < 1e-6 and nfe > 12  # adaptive: it chooses its own steps, more than the 12 of the grid here


def test_adjoint_gradients_match_backpropagation():
    # 16 steps: at 8 the rk4 error alone is ~1e-4 of the largest gradient for some seeds (measured over seeds 0-3)
    direct = _small_ode(solver="rk4", depth=16)
    adjoint = _small_ode(solver="rk4", depth=16, adjoint=True)
    adjoint.load_state_dict(direct.state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grads = []
    for model in (direct, adjoint):
        model(x).square().sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert direct.nfe == adjoint.nfe == 64
    for k, g in grads[0].items():  # the adjoint solve differs from backprop by the rk4 error, O(h^4)
        torch.testing.assert_close(grads[1][k], g, rtol=0, atol=1e-4 * float(g.abs().max()), msg=k)


def test_centernorm_centres_and_scales_by_d_over_d_minus_1():
    norm = CenterNorm(5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 6.0))
        norm.bias.fill_(0.5)
    z = torch.randn(4, 5)
    expected = 1.25 * (z - z.mean(-1, keepdim=True)) * torch.arange(1.0, 6.0) + 0.5
    torch.testing.assert_close(norm(z), expected)
    model = create_model("ode-tiny-ssog", **TINY, norm="centernorm")
    assert isinstance(model.blocks.block.norm1, CenterNorm) and isinstance(model.blocks.block.norm2, CenterNorm)


# -- every family x mixer: gradients, finiteness, determinism, the forward contract ------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", MIXERS)
def test_every_parameter_gets_a_gradient(family, mixer):
    # the class-token head (SSoG's default head, avg, leaves the class token out of every loss by construction)
    model = open_steering(create_model(f"{family}-tiny-{mixer}", **TINY, num_registers=1, global_pool="token"))
    x = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(x)
    logits = model.forward_head(tokens)
    assert torch.isfinite(logits).all() and torch.isfinite(tokens).all()
    # a loss on every output token: with SSoG the register tokens and the last block's field reach only the patch
    # and register outputs (see the next test), so a class-token loss alone would not touch them
    loss = F.cross_entropy(logits, torch.tensor([1, 7])) + tokens[:, 1:].square().mean()
    loss.backward()
    missing = [k for k, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert not missing
    if mixer == "ssog-steered":
        leaves = {k.rsplit(".", 1)[-1] for k, _ in model.named_parameters()}
        assert {"alpha_mu", "alpha_sigma", "alpha_lambda"} <= leaves


FIELD_NAMES = ("mu", "rho", "ell", "theta", "alpha_mu", "alpha_sigma", "alpha_lambda", "mu_steer", "sigma_steer",
               "lambda_steer")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered"])
def test_with_ssog_the_class_token_never_sees_registers_nor_the_last_field(family, mixer):
    # docs/operator.md: patches never read prefix tokens, and a prefix token's mixer output is the mean of the patch
    # values. So under a class-token loss the register tokens get exactly zero gradient, and so does the last discrete
    # block's field (it only moves patch outputs); with MHA they do get one. A shared block (looped, ode) is trained
    # through its earlier applications.
    grads = {}
    for name in (mixer, "mha"):
        model = open_steering(create_model(f"{family}-tiny-{name}", **TINY, num_registers=1, global_pool="token"))
        F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 7])).backward()
        grads[name] = {k: p.grad for k, p in model.named_parameters()}
    assert torch.count_nonzero(grads["mha"]["reg_token"]) > 0
    assert grads[mixer]["reg_token"] is None or torch.count_nonzero(grads[mixer]["reg_token"]) == 0
    last = f"blocks.{len(model.mixers()) - 1}.attn."
    field = {k: g for k, g in grads[mixer].items() if k.startswith(last) and k.split(".")[3] in FIELD_NAMES}
    assert len(field) == (4 if mixer == "ssog" else 13)
    dead = [k for k, g in field.items() if g is None or torch.count_nonzero(g) == 0]
    assert dead == (list(field) if family == "vit" else [])
    assert torch.count_nonzero(grads[mixer]["blocks.0.attn.mu"]) > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["mha", "ssog-steered"])
def test_same_seed_same_model_same_output(family, mixer):
    x = torch.randn(2, 3, 32, 32)
    outs = []
    for _ in range(2):
        torch.manual_seed(1234)
        model = create_model(f"{family}-tiny-{mixer}", **TINY).eval()
        with torch.no_grad():
            outs += [model(x), model(x)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("family, applications", [("vit", 2), ("looped", 2), ("ode", 2)])
@pytest.mark.parametrize("mixer", ["mha-unfused", "ssog"])
def test_forward_features_contract(family, applications, mixer):
    model = create_model(f"{family}-tiny-{mixer}", **TINY, num_registers=2).eval()
    x = torch.randn(2, 3, 32, 48)  # 4 x 6 grid
    with torch.no_grad(), record_attention(model) as attns:
        tokens = model.forward_features(x)
    with torch.no_grad():
        pre = model.forward_features(x, pre_norm=True)
        logits = model(x)
    t = model.num_prefix_tokens + 4 * 6
    assert model.num_prefix_tokens == 3 and tokens.shape == pre.shape == (2, t, 192)
    torch.testing.assert_close(model.norm(pre), tokens)
    torch.testing.assert_close(model.forward_head(tokens), logits)
    assert len(attns) == model.depth == applications
    for a in attns:
        assert a.shape == (2, model.num_heads, t, t)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, model.num_heads, t))
    assert len(model.mixers()) == (2 if family == "vit" else 1)


def test_no_weight_decay_names_field_norms_biases_tokens_and_position():
    model = create_model("vit-tiny-ssog-steered", **TINY, num_registers=1)
    skip = model.no_weight_decay()
    names = dict(model.named_parameters())
    assert skip <= set(names)
    for name in ("pos_embed", "cls_token", "reg_token", "norm.weight", "norm.bias", "head.bias",
                 "blocks.0.norm1.weight", "blocks.1.mlp.fc1.bias", "patch_embed.proj.bias"):
        assert name in skip, name
    for field in ("mu", "rho", "ell", "theta", "alpha_mu", "alpha_sigma", "alpha_lambda", "v.bias", "proj.bias"):
        assert f"blocks.1.attn.{field}" in skip, field
    decayed = set(names) - skip
    for name in ("patch_embed.proj.weight", "head.weight", "blocks.0.mlp.fc1.weight", "blocks.0.attn.v.weight",
                 "blocks.0.attn.proj.weight", "blocks.0.attn.mu_steer.weight"):
        assert name in decayed, name


# -- resolution and patch-size transfer ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["mha", "ssog", "ssog-steered"])
def test_model_built_at_224_runs_at_160x192_and_384(family, mixer):
    model = create_model(f"{family}-tiny-{mixer}", num_classes=10, depth=1).eval()
    assert model.img_size == (224, 224) and model.grid_size == (14, 14)
    with torch.no_grad():
        for h, w in [(160, 192), (384, 384)]:
            tokens = model.forward_features(torch.randn(1, 3, h, w))
            assert tokens.shape == (1, 1 + (h // 16) * (w // 16), 192) and torch.isfinite(tokens).all()


@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered"])
def test_output_at_training_size_survives_a_round_trip_through_another_size(mixer):
    model = create_model(f"vit-tiny-{mixer}", **{**TINY, "img_size": 64}).eval()
    x, big = torch.randn(2, 3, 64, 64), torch.randn(2, 3, 96, 80)
    with torch.no_grad():
        before = model(x)
        model(big)
        after = model(x)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.pos_embed.shape == (1, 1 + 8 * 8, 192)


def test_patch_embedding_is_resized_by_the_pseudo_inverse():
    # FlexiViT: upsampling a patch by R and embedding it with the resized kernel equals embedding the original patch.
    model = create_model("vit-tiny-ssog", **TINY)  # patch 8 at 32 px
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    conv = model.patch_embed.proj.double()
    before = conv(x)
    model.set_patch_size(16)
    x_up = F.interpolate(x, size=(16, 16), mode="bicubic", antialias=True)
    after = model.patch_embed.proj.double()(x_up)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # timm computes the pseudo-inverse in float32
    naive = F.interpolate(conv.weight, size=(16, 16), mode="bicubic") / 4  # plain resize: off by ~0.5 here
    assert (F.conv2d(x_up, naive, conv.bias, stride=16) - before).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_set_patch_size_converts_the_model(family):
    model = create_model(f"{family}-tiny-ssog-steered", **{**TINY, "img_size": 64, "radius": 2.0}).eval()
    mixer = model.mixers()[0]
    mu, sigma = mixer.mu.detach().clone(), mixer.sigma().detach().clone()
    model.set_patch_size(4, rescale_field=True)  # 8 x 8 grid -> 16 x 16
    assert model.patch_size == 4 and model.grid_size == (16, 16) and model.pos_embed.shape == (1, 257, 192)
    assert model.patch_embed.proj.weight.shape[-2:] == (4, 4)
    torch.testing.assert_close(mixer.mu, 2 * mu)  # each Gaussian covers the same image area
    torch.testing.assert_close(mixer.sigma(), 2 * sigma)
    assert mixer.radius == 4.0
    with torch.no_grad():
        out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    twin = create_model(**model.config)  # the config follows the conversion
    twin.load_state_dict(model.state_dict(), strict=True)
    assert twin.mixers()[0].radius == 4.0 and twin.patch_size == 4
    model.set_patch_size(8, rescale_field=True)  # and back
    torch.testing.assert_close(mixer.mu, mu)
    torch.testing.assert_close(mixer.sigma(), sigma)


def test_set_patch_size_leaves_the_field_alone_unless_asked():
    model = create_model("vit-tiny-ssog", **{**TINY, "img_size": 64})
    mu, rho = model.blocks[0].attn.mu.detach().clone(), model.blocks[0].attn.rho.detach().clone()
    model.set_patch_size(4)
    torch.testing.assert_close(model.blocks[0].attn.mu, mu, rtol=0, atol=0)
    torch.testing.assert_close(model.blocks[0].attn.rho, rho, rtol=0, atol=0)


def test_a_model_never_declares_a_size_its_patch_does_not_divide():
    """The audit's C006 and C114: create_model(img_size=33, patch_size=4) and set_patch_size(3) on a 16 px model
    built a model that refused images of its own declared size; one check (`check_fit`) refuses them at the call."""
    from ssogvit.errors import InputError

    message = r"patch_size {} does not divide img_size \({s}, {s}\): the model would refuse images of its own size"
    with pytest.raises(InputError, match=message.format(4, s=33)):
        create_model("vit-tiny-ssog", **{**TINY, "img_size": 33, "patch_size": 4})
    model = create_model("vit-tiny-ssog", **{**TINY, "img_size": 16, "patch_size": 4})
    for change, (patch, size) in ((lambda: model.set_patch_size(3), (3, 16)),
                                  (lambda: model.set_input_size(patch_size=3), (3, 16)),
                                  (lambda: model.set_input_size(img_size=18), (4, 18))):
        with pytest.raises(InputError, match=message.format(patch, s=size)):
            change()
        assert model.config["img_size"] == (16, 16) and model.config["patch_size"] == 4
        assert model(torch.randn(1, 3, 16, 16)).shape == (1, model.num_classes)
    model.set_input_size(img_size=18, patch_size=3)  # the pair fits: both change together
    assert model(torch.randn(1, 3, 18, 18)).shape == (1, model.num_classes)
    padded = create_model("vit-tiny-ssog", **{**TINY, "img_size": 33, "patch_size": 4, "dynamic_img_pad": True})
    assert padded(torch.randn(1, 3, 33, 33)).shape == (1, padded.num_classes)


# -- global_pool: class token or patch mean ----------------------------------------------------------------------


@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered"])
def test_global_pool_avg_trains_the_last_ssog_field(mixer):
    # With the class-token head the last discrete block's SSoG field gets exactly zero gradient (docs/operator.md, see
    # above); the patch-mean head reads the patch outputs, so every parameter of that mixer is trained.
    grads = {}
    for pool in ("token", "avg"):
        torch.manual_seed(0)
        model = open_steering(create_model(f"vit-tiny-{mixer}", **{**TINY, "depth": 3}, global_pool=pool))
        F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 7])).backward()
        last = model.blocks[-1].attn
        grads[pool] = {k: p.grad for k, p in last.named_parameters()}
    assert {"mu", "rho", "ell", "theta"} <= set(grads["avg"])
    dead = [k for k, g in grads["avg"].items() if g is None or torch.count_nonzero(g) == 0]
    assert not dead
    assert grads["token"]["mu"] is None or torch.count_nonzero(grads["token"]["mu"]) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_global_pool_avg_head_reads_the_mean_of_the_patch_tokens(family):
    model = create_model(f"{family}-tiny-ssog", **TINY, num_registers=2, global_pool="avg").eval()
    assert model.global_pool == "avg" and model.num_prefix_tokens == 3
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape[1] == 3 + 16  # the class token is kept
        expected = model.head(tokens[:, model.num_prefix_tokens :].mean(1))
        torch.testing.assert_close(model.forward_head(tokens), expected, rtol=0, atol=0)
        torch.testing.assert_close(model(x), expected)
        token = create_model(f"{family}-tiny-ssog", **TINY, num_registers=2, global_pool="token").eval()
        assert token.global_pool == "token"
        tokens = token.forward_features(x)
        torch.testing.assert_close(token.forward_head(tokens), token.head(tokens[:, 0]), rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_head_is_the_mixers_own(family):
    # SSoG models read the mean of the patch tokens unless told otherwise, the attention mixers the class token
    # (ssogvit.layers.default_pool; docs/models.md, "The default head"); an explicit head always wins
    for mixer, pool in (("ssog", "avg"), ("ssog-steered", "avg"), ("mha", "token"), ("window", "token")):
        assert default_pool(mixer) == pool
        model = create_model(f"{family}-tiny-{mixer}", **TINY)
        assert model.global_pool == pool and model.config["global_pool"] == pool
        assert create_model(**model.config).global_pool == pool
    for pool in ("avg", "token"):
        assert create_model(f"{family}-tiny-ssog", **TINY, global_pool=pool).global_pool == pool
        assert create_model(f"{family}-tiny-mha", **TINY, global_pool=pool).global_pool == pool


@pytest.mark.parametrize("family", FAMILIES)
def test_global_pool_is_recorded_in_the_config(family):
    torch.manual_seed(0)
    model = create_model(f"{family}-tiny-ssog", **TINY, num_registers=1, global_pool="avg").eval()
    assert model.config["global_pool"] == "avg"
    assert create_model(f"{family}-tiny-ssog", **TINY, global_pool="token").config["global_pool"] == "token"
    twin = create_model(**model.config).eval()
    assert twin.global_pool == "avg" and twin.config == model.config
    twin.load_state_dict(model.state_dict())  # same architecture: the class token is there in both modes
    assert set(twin.state_dict()) == set(create_model(f"{family}-tiny-ssog", **TINY, num_registers=1).state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_unknown_global_pool_is_a_value_error_naming_the_valid_ones(family):
    with pytest.raises(ValueError, match=r"global_pool.*'max'.*'token'.*'avg'"):
        create_model(f"{family}-tiny-ssog", **TINY, global_pool="max")
    from ssogvit.models import FAMILIES as CLASSES

    with pytest.raises(ValueError, match=r"global_pool"):  # the classes check it too, not only create_model
        CLASSES[family](global_pool="max", embed_dim=192, num_heads=3, depth=1, num_classes=2)


@pytest.mark.parametrize("change", ["prune", "reset"])
def test_a_head_without_pooling_is_recorded_so_the_config_rebuilds_the_model(change):
    """Audit D139-D141: `prune_intermediate_layers` (timm's prune_head) and `reset_classifier(0, "")` leave a model
    that returns the unpooled tokens; its config recorded the old pool, so `create_model(**config)` rebuilt a model
    that pooled."""
    torch.manual_seed(0)
    m = create_model("vit-tiny-ssog", img_size=16, patch_size=4, depth=2, embed_dim=16, num_heads=2,
                     num_classes=3).eval()
    if change == "prune":
        m.prune_intermediate_layers(1)
    else:
        m.reset_classifier(0, global_pool="")
    assert m.config["global_pool"] == ""
    again = create_model(**m.config).eval()
    again.load_state_dict(m.state_dict())
    x = torch.randn(2, 3, 16, 16)
    assert m(x).shape == again(x).shape == (2, 17, 16) and torch.equal(m(x), again(x))
