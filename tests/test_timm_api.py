"""Issue 12: every family is a timm model: timm's ViT API, dense features, weights in and out, deployment."""

import os
import subprocess
import sys

import pytest
import timm
import torch

from ssogvit.export import export_model, parity
from ssogvit.models import create_model, from_pretrained, record_attention, timm_name
from ssogvit.train.io import export_safetensors

FAMILIES = ("vit", "looped", "ode")
TINY = dict(img_size=32, patch_size=8, depth=3, num_classes=10, num_registers=1)
SMALL = dict(embed_dim=48, num_heads=3)  # narrow: export and checkpointing tests


def tiny(family, mixer, **kw):
    return create_model(f"{family}-tiny-{mixer}", **{**TINY, **kw})


def open_steering(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".alpha_" in name:
                p.fill_(0.0)
            elif "_steer." in name:
                p.normal_(0.0, 0.05)
    return model


# -- timm's model API -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered", "mha"])
def test_timm_vit_api(family, mixer):
    model = tiny(family, mixer).eval()
    assert isinstance(model, timm.models.VisionTransformer)
    assert model.num_features == model.embed_dim == 192 and model.num_prefix_tokens == 2
    cfg = model.pretrained_cfg
    assert cfg is model.default_cfg and cfg["input_size"] == (3, 32, 32) and cfg["num_classes"] == 10
    assert cfg["first_conv"] == "patch_embed.proj" and cfg["classifier"] == "head" and len(cfg["mean"]) == 3
    assert model.get_classifier() is model.head
    x = torch.randn(2, 3, 32, 48)  # 4 x 6 grid
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 2 + 24, 192)
        read = {"token": tokens[:, 0], "avg": tokens[:, 2:].mean(1)}  # the class token, the mean of the patches
        own = "avg" if mixer.startswith("ssog") else "token"  # each mixer's default head (docs/models.md)
        other = ({"avg", "token"} - {own}).pop()
        assert model.global_pool == own
        pooled = model.forward_head(tokens, pre_logits=True)
        torch.testing.assert_close(pooled, read[own])
        torch.testing.assert_close(model.head(pooled), model(x))
        model.reset_classifier(5, other)
        assert model(x).shape == (2, 5) and model.config["num_classes"] == 5 and model.config["global_pool"] == other
        torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), read[other])
        model.reset_classifier(0)
        assert model(x).shape == (2, 192)
    assert {"pos_embed", "cls_token", "reg_token"} <= model.no_weight_decay()
    assert set(model.group_matcher()) == {"stem", "blocks"}
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(3, "max")


def test_blocks_take_timm_calls_and_refuse_what_they_cannot_do():
    from ssogvit.models import Block

    with pytest.raises(ValueError, match="qk_norm"):
        Block(16, 2, mixer="ssog", num_prefix_tokens=1, qk_norm=True)
    block = Block(16, 2, mixer="ssog", num_prefix_tokens=1)
    z = torch.randn(1, 1 + 6, 16)
    with pytest.raises(ValueError, match=r"needs the patch grid of its tokens: call block\(z, grid="):
        block(z)  # timm's call without the grid
    assert block(z, (2, 3)).shape == z.shape  # a tensor, like timm's Block
    assert block(z, grid=(3, 2)).shape == z.shape
    with pytest.raises(ValueError, match="no attention mask"):
        block(z, (2, 3), attn_mask=torch.ones(7, 7, dtype=torch.bool))


@pytest.mark.parametrize("family", FAMILIES)
def test_set_input_size_keeps_the_class_and_patch_position_layout(family):
    model = tiny(family, "ssog", num_registers=2).eval()
    x = torch.randn(2, 3, 48, 40)
    with torch.no_grad():
        before = model(x)  # position embedding resized on the fly
        model.set_input_size(img_size=(48, 40))
        assert model.pos_embed.shape == (1, 1 + 6 * 5, 192) and model.img_size == (48, 40)
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)
        assert create_model(**model.config).img_size == (48, 40)
    with pytest.raises(ValueError, match="square patches"):
        model.set_input_size(patch_size=(4, 8))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered", "mha"])
def test_forward_intermediates_are_block_applications(family, mixer):
    model = open_steering(tiny(family, mixer, depth=3)).eval()
    x = torch.randn(2, 3, 40, 32)  # 5 x 4 grid
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True)
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=1e-6)
        assert len(inter) == 3
        # by hand: the tokens after each block application (discrete block, loop iteration or ODE grid step)
        z, grid = model.embed(x)
        assert grid == (5, 4)
        for k, step in enumerate(model.blocks):
            z = step(z, grid)
            patches, prefix = inter[k]
            torch.testing.assert_close(torch.cat([prefix, patches], 1), z, rtol=0, atol=1e-6)
        maps = model.forward_intermediates(x, indices=[0, 2], norm=True, intermediates_only=True)
        assert [m.shape for m in maps] == [(2, 192, 5, 4)] * 2
        torch.testing.assert_close(maps[1].flatten(2).transpose(1, 2), final[:, 2:], rtol=0, atol=1e-6)
        kept = model.prune_intermediate_layers([1])
        assert kept == [1] and len(model.blocks) == 2 and model(x).shape == (2, 2 + 20, 192)  # no head, no pool
        assert model.depth == model.config["depth"] == 2
        torch.testing.assert_close(model.forward_features(x), model.norm(torch.cat(inter[1][::-1], 1)), atol=1e-5,
                                   rtol=0)
        twin = create_model(**model.config).eval()  # the config describes the pruned model
        twin.load_state_dict(model.state_dict())
        torch.testing.assert_close(twin.forward_features(x), model.forward_features(x), atol=1e-5, rtol=0)


def test_a_looped_intermediate_is_an_iteration_and_an_ode_one_a_grid_step():
    looped = tiny("looped", "ssog").eval()
    ode = tiny("ode", "ssog", depth=4).double().eval()
    assert len(looped.blocks) == 3 and all(b is looped.blocks.block for b in looped.blocks)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        inter = ode.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True)
        z, grid = ode.embed(x)
        block = ode.blocks.block
        for k in range(4):  # Euler on t_k = k / 4 with scale 4: z <- z + (1/4) * 4 * f(z)
            z = z + 0.25 * ode.scale * block.vector_field(z, grid)
            torch.testing.assert_close(torch.cat(inter[k][::-1], 1), z, rtol=0, atol=1e-12)
    assert ode.nfe == 4


@pytest.mark.parametrize("solver", ["euler", "midpoint", "heun2", "heun3", "rk4"])
def test_stepped_ode_solve_equals_torchdiffeq_odeint(solver):
    # the model takes the grid steps one by one with torchdiffeq's own step functions: the same as odeint on the grid
    from torchdiffeq import odeint

    model = open_steering(tiny("ode", "ssog-steered", solver=solver, depth=3)).double().eval()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        out = model.forward_features(x, pre_norm=True)
        z, grid = model.embed(x)
        block = model.blocks.block
        path = odeint(lambda t, y: model.scale * block.vector_field(y, grid), z, model.time_grid(z), method=solver)
    torch.testing.assert_close(out, path[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("solver, kw", [("dopri5", {}), ("rk4", {"adjoint": True}), ("explicit_adams", {})])
def test_an_ode_solve_that_cannot_be_split_refuses_intermediates(solver, kw):
    model = tiny("ode", "ssog", solver=solver, **kw).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
        with pytest.raises(ValueError, match="cannot be split into grid steps"):
            model.forward_intermediates(x)
    with pytest.raises(ValueError, match="cannot be split"):  # at the call (the fifth audit's E151), not the forward
        model.set_grad_checkpointing()
    assert not model.grad_checkpointing and torch.isfinite(model(x)).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered"])
def test_features_only_returns_nchw_maps_at_any_size(family, mixer):
    name = timm_name(f"{family}-tiny-{mixer}")
    backbone = timm.create_model(name, features_only=True, out_indices=(0, 2), img_size=32, patch_size=8, depth=3)
    assert backbone.feature_info.channels() == [192, 192] and backbone.feature_info.reduction() == [8, 8]
    with torch.no_grad():
        for h, w in [(32, 32), (48, 24), (64, 40)]:
            feats = backbone(torch.randn(2, 3, h, w))
            assert [f.shape for f in feats] == [(2, 192, h // 8, w // 8)] * 2
            assert all(torch.isfinite(f).all() for f in feats)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered", "mha"])
def test_grad_checkpointing_saves_activations_and_keeps_gradients(family, mixer):
    torch.manual_seed(0)
    model = open_steering(create_model(f"{family}-tiny-{mixer}", **{**TINY, **SMALL, "depth": 4}))
    x = torch.randn(2, 3, 32, 32)

    def run(checkpointing):
        model.zero_grad()
        model.set_grad_checkpointing(checkpointing)
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).square().sum()
        loss.backward()
        return sum(saved), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    plain, grads = run(False)
    checkpointed, grads_ckpt = run(True)
    assert model.grad_checkpointing
    # the hook sees what autograd saves outside the checkpointed blocks; each of those keeps its input tokens instead
    tokens = model.embed(x)[0]
    kept_inputs = len(model.blocks) * tokens.numel() * tokens.element_size()
    assert checkpointed + kept_inputs < 0.5 * plain, (checkpointed, kept_inputs, plain)
    assert grads.keys() == grads_ckpt.keys()
    for k, g in grads.items():
        torch.testing.assert_close(grads_ckpt[k], g, rtol=1e-5, atol=1e-7, msg=k)


def _two_grid_gradients(model, checkpointing, forward=None):
    """Gradients of one backward through two forwards at the grids (8, 12) and (12, 8) (patch 8), as in multi-crop
    training: the two grids have the same number of tokens, so only the grid tells them apart."""
    torch.manual_seed(1)
    a, b = torch.randn(2, 3, 64, 96), torch.randn(2, 3, 96, 64)
    forward = forward or model
    model.zero_grad()
    model.set_grad_checkpointing(checkpointing)
    (forward(a).square().sum() + forward(b).square().sum()).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_same_gradients(got, want):
    assert got.keys() == want.keys() and got
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered"])
def test_two_forwards_at_two_grids_then_one_backward_give_the_same_gradients_with_checkpointing(family, mixer):
    model = open_steering(create_model(f"{family}-tiny-{mixer}", **{**TINY, **SMALL, "depth": 2}))
    _assert_same_gradients(_two_grid_gradients(model, True), _two_grid_gradients(model, False))


def test_checkpointing_works_in_a_fresh_process_where_the_cpu_kernel_checks_itself_inside_a_checkpointed_block():
    # the kernel's first-use self-check runs autograd on its own tensors; inside a checkpointed block the
    # checkpoint's saved-tensor hooks took them for the block's, and the first backward of a new process failed
    code = ("import torch; from ssogvit.models import create_model; "
            "m = create_model('vit-tiny-ssog-steered', img_size=32, patch_size=8, depth=2, num_classes=3, "
            "embed_dim=48, num_heads=3); m.set_grad_checkpointing(True); "
            "m(torch.randn(2, 3, 32, 32)).sum().backward(); print(m.blocks[0].attn.v.weight.grad.abs().sum() > 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "tensor(True)", done.stderr[-2000:]


def test_blocks_shared_by_two_models_take_each_models_grid():
    # nested / shared use: the same block modules in a second model, run in between (a teacher inside a student)
    outer = open_steering(create_model("vit-tiny-ssog-steered", **{**TINY, **SMALL, "depth": 2}))
    inner = create_model("vit-tiny-ssog-steered", **{**TINY, **SMALL, "depth": 2})
    inner.blocks = outer.blocks
    a, b = torch.randn(1, 3, 64, 96), torch.randn(1, 3, 96, 64)

    def run(checkpointing):
        outer.zero_grad()
        outer.set_grad_checkpointing(checkpointing)
        inner.set_grad_checkpointing(checkpointing)
        (outer(a).sum() + inner(b).square().sum()).backward()
        return {k: p.grad.clone() for k, p in outer.named_parameters() if p.grad is not None}

    _assert_same_gradients(run(True), run(False))


@pytest.mark.parametrize("reentrant", [False, True], ids=["timm-default", "reentrant"])
def test_an_ssogified_timm_vit_checkpoints_two_grids_right(reentrant):
    import ssogvit
    from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt

    vit = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=8, depth=2, num_classes=3, embed_dim=48,
                            num_heads=3, reg_tokens=1, dynamic_img_size=True)
    open_steering(ssogvit.ssogify(vit, mixer="ssog-steered"))
    before = use_reentrant_ckpt()
    set_reentrant_ckpt(reentrant)
    try:
        checkpointed = _two_grid_gradients(vit, True)
    finally:
        set_reentrant_ckpt(before)
    _assert_same_gradients(checkpointed, _two_grid_gradients(vit, False))


# -- attention maps --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered", "mha"])
def test_record_attention_gives_one_stochastic_map_per_application(family, mixer):
    model = open_steering(tiny(family, mixer, depth=2))
    x = torch.randn(2, 3, 32, 40)
    with record_attention(model) as maps:
        out = model(x)
    t = 2 + 4 * 5
    assert len(maps) == 2 and all(m.shape == (2, 3, t, t) for m in maps)
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 3, t))
    maps[-1].square().sum().backward()  # differentiable: the JaSMin penalty trains through the maps
    if family == "vit":  # the last block's map does not depend on its own output projection
        assert model.mixers()[-1].proj.weight.grad is None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mixers()[-1].parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(x), out.detach())  # hooks removed, same output
    assert not any(m._forward_hooks for m in model.mixers())


def test_record_attention_works_on_an_ssogified_timm_vit():
    import ssogvit

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=3, reg_tokens=1,
                            dynamic_img_size=True)
    ssogvit.ssogify(vit, mixer="ssog-steered")
    with torch.no_grad(), record_attention(vit) as maps:
        vit(torch.randn(1, 3, 32, 48))
    t = 2 + 4 * 6
    assert len(maps) == 2 and maps[0].shape == (1, 3, t, t)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(1, 3, t))


# -- weights in and out ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered", "mha"])
def test_save_pretrained_round_trips_bit_for_bit(family, mixer, tmp_path):
    model = open_steering(tiny(family, mixer, **({"solver": "rk4"} if family == "ode" else {}))).eval()
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    twin = from_pretrained(tmp_path).eval()
    assert type(twin) is type(model) and twin.config == model.config
    assert twin.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))
    with pytest.raises(FileExistsError, match="overwrite"):
        model.save_pretrained(tmp_path, overwrite=False)
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize("family", ["vit", "ode"])
def test_reset_classifier_checks_its_arguments_and_save_pretrained_writes_only_what_loads(family, tmp_path):
    """The audit's C115 and C128: reset_classifier(-1) was accepted, and after reset_classifier(3, "token") on an
    SSoG model save_pretrained wrote a folder (timm's fc_norm in its model_args) that from_pretrained refused."""
    from ssogvit.errors import InputError

    model = tiny(family, "ssog").eval()
    with pytest.raises(InputError, match=r"num_classes=-1: expected an integer in \[0, 1000000\]"):
        model.reset_classifier(-1)
    with pytest.raises(InputError, match="unknown global_pool 'bogus'"):
        model.reset_classifier(3, global_pool="bogus")
    assert model.num_classes == model.config["num_classes"] != -1
    model.reset_classifier(3, global_pool="token")
    model.save_pretrained(tmp_path / "token")
    twin = from_pretrained(tmp_path / "token").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert twin.config == model.config and torch.equal(twin(x), model(x))
    model.config["depth"] = 0  # a config its loader refuses: never written
    with pytest.raises(InputError, match="save_pretrained: from_pretrained would refuse the folder"):
        model.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_timm_loads_our_exported_weights(family, tmp_path):
    model = open_steering(tiny(family, "ssog-steered")).eval()
    file = export_safetensors(model, tmp_path / "model.safetensors")
    name = timm_name(model.config["name"])
    loaded = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(file))).eval()
    assert loaded.config == model.config
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(ValueError, match="holds weights of"):
        timm.create_model(timm_name(f"{family}-tiny-mha"), pretrained=True, pretrained_cfg_overlay=dict(file=str(file)))
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model(name, pretrained=True)


# -- deployment ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ssog", "ssog-steered"])
def test_traced_mixer_takes_the_functional_path_and_matches_the_dense_reference(name):
    from ssogvit import ops, reference
    from ssogvit.layers import create_mixer

    mixer = open_steering(create_mixer(name, 12, 3, head_chunk=1)).double().eval().requires_grad_(False)
    x = torch.randn(2, 2 + 3 * 5, 12, dtype=torch.float64)

    class Grid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = mixer

        def forward(self, tokens):
            assert ops.functional_only()  # tracing: no in-place or preallocated-buffer shortcut
            return self.mixer(tokens, grid=(3, 5), num_prefix_tokens=2)

    with torch.no_grad():
        traced = torch.jit.trace(Grid(), (x,), check_trace=False)
        y = torch.randn_like(x)
        expected = mixer.proj(reference.dense_mix(mixer.attention_matrix(y, (3, 5), num_prefix_tokens=2), mixer.v(y)))
        torch.testing.assert_close(traced(y), expected, rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="cannot be traced"):
            torch.jit.trace(lambda v: ops.ssog_mix(v, (3, 5), *mixer._fixed_kernels((3, 5), v.dtype), inplace=True),
                            (mixer.v(x),))


#: the dynamic exporters (torch.export, dynamo ONNX: 20-50 s each): by default only the steered ViT's torch.export
#: (the dynamo ONNX exporter translates that program; the fixed ViT goes through both in
#: tests/test_export_contract.py), every other model's under `slow`
_SLOW_EXPORTS = {(f, m, fmt, True) for f in FAMILIES for m in ("ssog", "ssog-steered", "mha")
                 for fmt in ("onnx", "exported-program") if (f, m, fmt) != ("vit", "ssog-steered", "exported-program")}
_EXPORT_FORMATS = [("exported-program", True), ("onnx", True), ("onnx", False), ("torchscript", False)]
_EXPORT_IDS = {("exported-program", True): "export", ("onnx", True): "onnx-dynamo", ("onnx", False): "onnx-torchscript",
               ("torchscript", False): "torchscript"}


@pytest.mark.parametrize(
    "family, mixer, fmt, dynamo",
    [pytest.param(f, m, fmt, dyn, id=f"{_EXPORT_IDS[fmt, dyn]}-{f}-{m}",
                  marks=[pytest.mark.slow] if (f, m, fmt, dyn) in _SLOW_EXPORTS else [])
     # every family with both SSoG mixers; MHA (nothing family-specific in it) once
     for f, m in [(f, m) for f in FAMILIES for m in ("ssog", "ssog-steered")] + [("vit", "mha")]
     for fmt, dyn in _EXPORT_FORMATS],
)
def test_exported_model_computes_what_the_eager_model_computes_at_other_shapes(family, mixer, fmt, dynamo, tmp_path):
    from ssogvit.export import dynamic_dims, load_exported, second_shape

    torch.manual_seed(0)
    model = open_steering(create_model(f"{family}-tiny-{mixer}", **{**TINY, **SMALL, "depth": 1})).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model(x)  # an eager call first: a cached kernel table must not leak into the graph as a stale constant
    path = export_model(model, x, tmp_path / "model", format=fmt, dynamo=dynamo)
    dims = dynamic_dims(fmt, dynamo)
    assert "batch" in dims and ("size" in dims) == (fmt == "exported-program" or dynamo)
    shapes = [(2, 3, 32, 32), second_shape((2, 3, 32, 32), dims, 8), (3, 3, 32, 32)]
    if "size" in dims:
        assert shapes[1] == (1, 3, 40, 48)
        shapes.append((3, 3, 16, 40))  # a smaller, rectangular grid (2 x 5)
    for shape in shapes:
        diff = parity(model, path, torch.randn(shape), format=fmt)
        assert diff < 1e-4, (shape, diff)
    if "size" not in dims:  # the file refuses another image size instead of computing it wrong
        refusal = "Got invalid dimensions" if fmt == "onnx" else "computes on 32x32 images only, got 40x48"
        with pytest.raises(Exception, match=refusal):
            load_exported(path, format=fmt)(torch.randn(1, 3, 40, 48))


def test_the_steered_model_exports_with_bounded_dynamic_sides(monkeypatch):
    """Issue 34, 5: ``torch.export`` with ``Dim("H", min=2, max=64) * patch`` keeps the declared range and computes
    what the eager model computes at both ends of it; the head-chunk sizing, whose arithmetic guards the grid, is not
    traced (an exported steered mixing is the einsum path, which has no chunks)."""
    import ssogvit.layers.ssog as ssog_layer

    torch.manual_seed(0)
    model = open_steering(create_model("vit-tiny-ssog-steered", **{**TINY, **SMALL, "depth": 1, "patch_size": 4}))
    sized = []
    monkeypatch.setattr(ssog_layer, "default_head_chunk", lambda *a, **k: sized.append(a) or 1)
    side = {2: 4 * torch.export.Dim("H", min=2, max=64), 3: 4 * torch.export.Dim("W", min=2, max=64)}
    with torch.enable_grad():  # parameters that want grads: the training-time sizing is the one that guarded
        program = torch.export.export(model, (torch.randn(2, 3, 32, 32),), dynamic_shapes=(side,))
    assert sized == []
    ranges = [(int(r.lower), int(r.upper)) for r in program.range_constraints.values()]
    assert ranges.count((2, 64)) == 2, ranges  # H and W as declared (and 4 H, 4 W beside them)
    with torch.no_grad():
        for shape in ((2, 3, 8, 8), (2, 3, 256, 12)):  # grids 2 x 2 and 64 x 3: the ends of the range
            x = torch.randn(shape)
            assert torch.allclose(program.module()(x), model(x), atol=1e-5), shape


def test_a_dynamic_export_is_not_traced_at_a_size_an_exporter_would_fix(tmp_path):
    model = create_model("vit-tiny-ssog", **{**TINY, **SMALL, "depth": 1}).eval()
    with pytest.raises(ValueError, match="dynamic batch is traced at batch 2 or more"):
        export_model(model, torch.randn(1, 3, 32, 32), tmp_path / "m.pt2", format="exported-program")
    with pytest.raises(ValueError, match="grid of 2 x 2 patches or more, got 8x32"):
        export_model(model, torch.randn(2, 3, 8, 32), tmp_path / "m.pt2", format="exported-program")
    static = export_model(model, torch.randn(1, 3, 32, 32), tmp_path / "m.onnx", format="onnx", dynamic=False)
    assert parity(model, static, torch.randn(1, 3, 32, 32), format="onnx") < 1e-4
    with pytest.raises(Exception, match="Got invalid dimensions"):
        parity(model, static, torch.randn(2, 3, 32, 32), format="onnx")


@pytest.mark.slow
def test_export_cli_writes_a_dynamic_file_and_prints_its_parity_at_two_shapes(tmp_path):
    model = open_steering(create_model("vit-tiny-ssog-steered", **{**TINY, **SMALL, "depth": 1}))
    ckpt = export_safetensors(model, tmp_path / "model.safetensors")
    cmd = [sys.executable, "-m", "ssogvit", "export", "--ckpt", str(ckpt)]
    done = subprocess.run(cmd + ["--format", "onnx"], capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "model.onnx").is_file()
    assert "it takes any batch and image size (a multiple of the patch size)" in done.stdout
    checks = [line for line in done.stdout.splitlines() if line.startswith("parity on a random batch")]
    assert [c.split("batch ")[1].split(":")[0] for c in checks] == ["(2, 3, 32, 32)", "(1, 3, 40, 48)",
                                                                     "(1, 3, 16, 24)"]
    assert all(float(c.split("max abs difference ")[1].split()[0]) < 1e-4 for c in checks)
    again = subprocess.run(cmd + ["--format", "onnx"], capture_output=True, text=True, env=os.environ.copy())
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr
    bad = subprocess.run([sys.executable, "-m", "ssogvit", "export", "--ckpt", str(tmp_path / "nope.ckpt"),
                          "--format", "onnx"], capture_output=True, text=True, env=os.environ.copy())
    assert bad.returncode == 2 and "nope.ckpt does not exist" in bad.stderr and "Traceback" not in bad.stderr


def test_export_cli_says_what_a_format_cannot_make_dynamic_and_refuses_what_would_fix_a_dimension(tmp_path, capsys):
    import ssogvit.export

    model = create_model("ode-tiny-ssog", **{**TINY, **SMALL, "depth": 1})
    ckpt = export_safetensors(model, tmp_path / "model.safetensors")
    base = ["--ckpt", str(ckpt), "--format"]
    assert ssogvit.export.main(base + ["onnx", "--onnx-exporter", "torchscript"]) == 0
    out = capsys.readouterr().out
    assert ("it takes any batch; 32x32 images only (the TorchScript-based ONNX exporter cannot export the position "
            "embedding's resize; the file refuses other sizes)") in out
    assert "batch (1, 3, 32, 32)" in out  # the second check: another batch at the traced size
    assert ssogvit.export.main(base + ["torchscript", "--out", str(tmp_path / "m.onnx")]) == 2  # was written as named
    assert "--out " + str(tmp_path / "m.onnx") + ": a torchscript file is named *.pt" in capsys.readouterr().err
    assert ssogvit.export.main(base + ["torchscript", "--onnx-exporter", "torchscript"]) == 2  # was ignored
    assert "--onnx-exporter chooses the exporter of --format onnx; --format torchscript has none" in (
        capsys.readouterr().err)
    assert ssogvit.export.main(base + ["torchscript", "--img-size", "48", "40"]) == 0
    out = capsys.readouterr().out
    assert "48x40 images only (a traced TorchScript graph holds the grid as constants" in out
    assert "batch (2, 3, 48, 40)" in out and "batch (1, 3, 48, 40)" in out
    assert ssogvit.export.main(base + ["exported-program", "--batch", "1"]) == 2
    assert "a dynamic batch is traced at --batch 2 or more" in capsys.readouterr().err
    assert ssogvit.export.main(base + ["exported-program", "--img-size", "8", "32"]) == 2
    assert "traced at 2 x 2 patches or more (16 px here), got 8x32" in capsys.readouterr().err
    assert ssogvit.export.main(base + ["exported-program", "--img-size", "30", "32"]) == 2
    assert "--img-size 30 32 is not a multiple of the patch size 8" in capsys.readouterr().err
    out_file = tmp_path / "static.pt2"
    assert ssogvit.export.main(base + ["exported-program", "--static", "--batch", "1", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "batch 1 and 32x32 images, the traced shape (--static: checked at it only)" in out
    assert len([line for line in out.splitlines() if line.startswith("parity")]) == 1
    adaptive = export_safetensors(create_model("ode-tiny-ssog", **{**TINY, **SMALL, "depth": 1}, solver="dopri5"),
                                  tmp_path / "adaptive" / "model.safetensors")
    assert ssogvit.export.main(["--ckpt", str(adaptive), "--format", "exported-program"]) == 2  # data-dependent steps
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ssogvit export: exported-program could not export this model (ValueError: the ODE solver 'dopri5' "
                   "chooses its number of steps from the data, which no exported format can hold; export the model "
                   "built with a fixed-step solver (solver='rk4' or 'euler', the same weights)); --debug shows the "
                   "traceback"]  # one line: torch's graph dump came first
    assert not (tmp_path / "adaptive" / "model.pt2").exists()


def test_export_cli_fails_with_exit_2_when_parity_is_worse_than_the_tolerance(tmp_path, monkeypatch, capsys):
    import ssogvit.export

    model = create_model("vit-tiny-ssog", **{**TINY, **SMALL, "depth": 1})
    ckpt = export_safetensors(model, tmp_path / "model.safetensors")
    monkeypatch.setattr(ssogvit.export, "parity", lambda *a, **k: 6.0)  # what the old TorchScript export measured
    assert ssogvit.export.main(["--ckpt", str(ckpt), "--format", "torchscript"]) == 2
    err = capsys.readouterr().err
    assert "6.000e+00 is worse than the tolerance 1e-04" in err and "was not written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.safetensors"]  # no file, no temporary
    with pytest.raises(SystemExit) as exit_:
        ssogvit.export.main(["--ckpt", str(ckpt), "--format", "onnx", "--tolerance", "-1"])
    assert exit_.value.code == 2
    assert "argument --tolerance: expected a number >= 0, got '-1'" in capsys.readouterr().err
