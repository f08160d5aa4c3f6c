"""SSoG dropped into timm's VisionTransformer with ssogify()."""

import copy

import pytest
import timm
import torch

import ssogvit
from ssogvit.timm_compat import TimmSSoGAttention


def tiny_vit(**kw):
    return timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64, **kw)


@pytest.mark.parametrize(
    "kw",
    [{}, {"dynamic_img_size": True}, {"reg_tokens": 4}, {"class_token": False, "global_pool": "avg"}],
    ids=["plain", "dynamic", "registers", "no-cls"],
)
def test_ssogify_swaps_every_attention_and_carries_v_and_proj(kw):
    model = tiny_vit(**kw)
    qkv = [b.attn.qkv.weight.detach().clone() for b in model.blocks]
    qkv_b = [b.attn.qkv.bias.detach().clone() for b in model.blocks]
    proj = [b.attn.proj.weight.detach().clone() for b in model.blocks]
    ssogvit.ssogify(model)
    d = model.embed_dim
    for i, block in enumerate(model.blocks):
        assert isinstance(block.attn, TimmSSoGAttention)
        torch.testing.assert_close(block.attn.v.weight, qkv[i][2 * d :], rtol=0, atol=0)
        torch.testing.assert_close(block.attn.v.bias, qkv_b[i][2 * d :], rtol=0, atol=0)
        torch.testing.assert_close(block.attn.proj.weight, proj[i], rtol=0, atol=0)
    y = model(torch.randn(2, 3, 64, 64))
    assert y.shape == (2, 10) and torch.isfinite(y).all()
    assert model.blocks[0].attn._grid_tracker.grid == (4, 4)


def test_ssogify_output_equals_mixing_with_the_explicit_grid():
    model = tiny_vit(reg_tokens=2).eval()
    ssogvit.ssogify(model)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        tokens = model._pos_embed(model.patch_embed(x))
        tokens = model.norm_pre(tokens)
        block = model.blocks[0]
        expected = block.attn(block.norm1(tokens), grid=(4, 4))
        assert model.num_prefix_tokens == 3
        got = block.attn(block.norm1(tokens))  # grid from the hook
    torch.testing.assert_close(got, expected)


def test_dynamic_image_size_changes_the_grid_per_call():
    model = tiny_vit(dynamic_img_size=True).eval()
    ssogvit.ssogify(model, mixer="ssog-steered")
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 80)).shape == (1, 10)
        assert model.blocks[0].attn._grid_tracker.grid == (3, 5)
        assert model(torch.randn(1, 3, 96, 64)).shape == (1, 10)
        assert model.blocks[0].attn._grid_tracker.grid == (6, 4)


def test_deepcopy_for_ema_keeps_its_own_grid():
    model = tiny_vit(dynamic_img_size=True).eval()
    ssogvit.ssogify(model)
    ema = copy.deepcopy(model)
    tracker = ema.blocks[0].attn._grid_tracker
    assert tracker is not model.blocks[0].attn._grid_tracker
    assert all(b.attn._grid_tracker is tracker for b in ema.blocks)
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), model(x))
    assert tracker.grid == (3, 4)


def test_ssogify_rejects_masks_and_bad_arguments():
    model = tiny_vit()
    with pytest.raises(ValueError, match="mixer='mha': expected one of 'ssog', 'ssog-steered'"):
        ssogvit.ssogify(model, mixer="mha")
    ssogvit.ssogify(model)
    with pytest.raises(ValueError, match="no attention mask"):
        model.blocks[0].attn(torch.randn(1, 17, 192), attn_mask=torch.ones(17, 17, dtype=torch.bool))


def test_ssogify_refuses_attention_dropout_which_ssog_cannot_carry():
    """The fifth audit's E199: an attention dropout would vanish from the converted model without a word."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, attn_drop_rate=0.5)
    with pytest.raises(ValueError, match=r"attention dropout \(attn_drop_rate > 0\)"):
        ssogvit.ssogify(model)
    assert type(model.blocks[0].attn).__name__ == "Attention"  # nothing was swapped


def _decay_of(optimizer, model):
    """Parameter name -> the weight decay timm's optimizer applies to it."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("mixer", ["ssog", "ssog-steered"])
def test_timms_optimizer_factory_leaves_the_fields_undecayed_as_in_ssogvits_own_models(mixer):
    from timm.optim import create_optimizer_v2

    model = ssogvit.ssogify(tiny_vit(depth=2), mixer=mixer)
    decay = _decay_of(create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05), model)
    fields = {f"blocks.{i}.attn.{n}" for i, b in enumerate(model.blocks) for n in b.attn.no_weight_decay()}
    assert fields and {n: decay[n] for n in fields} == dict.fromkeys(fields, 0.0)
    assert {"pos_embed", "cls_token"} <= model.no_weight_decay()  # timm's own names are kept
    assert decay["blocks.0.attn.v.weight"] == decay["blocks.0.mlp.fc1.weight"] == 0.05
    if mixer == "ssog-steered":
        assert decay["blocks.1.attn.mu_steer.weight"] == 0.05  # the steering maps are weights, as in our models
    # ssogvit's own model with the same mixer: the same split of the mixer's parameters
    ours = ssogvit.create_model(f"vit-tiny-{mixer}", img_size=64, depth=2, num_classes=10)
    ours_decay = _decay_of(create_optimizer_v2(ours, "adamw", lr=1e-3, weight_decay=0.05), ours)
    assert {n: d for n, d in ours_decay.items() if ".attn." in n} == {n: d for n, d in decay.items() if ".attn." in n}


@pytest.mark.parametrize("build", ["timm", "ssogvit-mha"])
def test_an_ssogified_model_round_trips_through_save_pretrained_and_timm_local_dir_bit_for_bit(build, tmp_path):
    if build == "timm":
        model = tiny_vit(depth=2, reg_tokens=1, dynamic_img_size=True)
    else:
        model = ssogvit.create_model("looped-tiny-mha", img_size=32, patch_size=8, depth=2, num_classes=3)
    ssogvit.ssogify(model, mixer="ssog-steered", num_atoms=3, radius=2.0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every parameter away from its initial value
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    twin = timm.create_model(f"local-dir:{tmp_path}", pretrained=True)
    assert type(twin) is type(model) and isinstance(twin.blocks[0].attn, TimmSSoGAttention)
    assert twin.blocks[0].attn.num_atoms == 3 and twin.blocks[0].attn.radius == 2.0
    assert twin.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        assert torch.equal(twin.eval()(x), model.eval()(x))
    assert twin.no_weight_decay() == model.no_weight_decay()
    with pytest.raises(FileExistsError, match="overwrite"):
        model.save_pretrained(tmp_path, overwrite=False)
    twin.save_pretrained(tmp_path / "again")  # and round again from the reloaded model
    again = timm.create_model(f"local-dir:{tmp_path / 'again'}", pretrained=True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_an_ssogified_save_pretrained_is_sealed_so_an_edited_config_or_tensor_is_refused_on_load(tmp_path):
    """The audit's A47: ssogify's save_pretrained writes through the one sealing writer of every save_pretrained
    (docs/models.md, "Saved and exported weights"); timm's local-dir load checks the digest and config.json."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ssogvit.models.sealed import DIGEST_KEY, WeightsFileError

    model = ssogvit.ssogify(tiny_vit(depth=1), num_atoms=3)
    model.save_pretrained(tmp_path / "saved")
    weights, side = tmp_path / "saved" / "model.safetensors", tmp_path / "saved" / "config.json"
    with safe_open(str(weights), framework="pt") as f:
        header = dict(f.metadata())
    assert DIGEST_KEY in header
    original = side.read_text()
    edited = json.loads(original)
    edited["model_args"]["ssogify_options"]["num_atoms"] = 2
    side.write_text(json.dumps(edited))
    with pytest.raises(WeightsFileError, match=r"config.json does not match .*ssogify_options\.num_atoms: 2"):
        timm.create_model(f"local-dir:{tmp_path / 'saved'}", pretrained=True)
    side.write_text(original)
    state = load_file(str(weights))
    state["blocks.0.attn.proj.bias"] = state["blocks.0.attn.proj.bias"] + 1
    save_file(state, str(weights), metadata=header)
    with pytest.raises(WeightsFileError, match="fails its integrity check"):
        timm.create_model(f"local-dir:{tmp_path / 'saved'}", pretrained=True)
