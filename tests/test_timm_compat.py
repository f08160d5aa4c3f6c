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
