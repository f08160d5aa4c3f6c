"""Edges of the mixer and of ssogify where a wrong input used to give a silently wrong result (issue 11)."""

import numpy as np
import pytest
import timm
import torch

import ssogvit
from ssogvit import ops
from ssogvit.layers import create_mixer
from ssogvit.timm_compat import TimmSSoGAttention

MIXERS = ["ssog", "ssog-steered", "mha"]


@pytest.mark.parametrize("name", MIXERS)
@pytest.mark.parametrize("grid", [(4.9, 4.2), (4.0, 4.0), ("4", "4"), (True, 4), (4,), (4, 4, 1)])
def test_mixers_reject_non_integer_grids(name, grid):
    mixer = create_mixer(name, 16, 2)
    with pytest.raises(ValueError, match="grid"):
        mixer(torch.randn(1, 17, 16), grid=grid)


@pytest.mark.parametrize("grid", [(np.int64(4), np.int64(4)), (torch.tensor(4), torch.tensor(4)), [4, 4]])
def test_integer_grids_of_other_types_are_accepted(grid):
    mixer = create_mixer("ssog", 16, 2).eval()
    x = torch.randn(1, 17, 16)
    torch.testing.assert_close(mixer(x, grid=grid), mixer(x, grid=(4, 4)), rtol=0, atol=0)


@pytest.mark.parametrize("name", MIXERS)
def test_a_grid_that_does_not_match_the_prefix_count_is_an_error(name):
    mixer = create_mixer(name, 16, 2)
    x = torch.randn(1, 1 + 16, 16)
    mixer(x, grid=(4, 4), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"expected P \+ Gh\*Gw = 1 \+ 3\*5 = 16 tokens"):
        mixer(x, grid=(3, 5), num_prefix_tokens=1)  # without the count, one patch would become a prefix token
    with pytest.raises(ValueError, match="does not fit the grid"):
        mixer(x, grid=(4, 4), num_prefix_tokens=2)


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
def test_models_pass_their_prefix_count_to_every_mixer(family):
    model = ssogvit.create_model(f"{family}-tiny-ssog", embed_dim=32, num_heads=2, depth=1, img_size=16, patch_size=4,
                                 num_classes=3, num_registers=2)
    block = model.blocks[0]  # the first block application (an ODE grid step for ode)
    tokens, grid = model.embed(torch.randn(1, 3, 16, 16))  # the grid every block application takes
    assert tokens.shape[1] == 3 + 16 and grid == (4, 4)
    block(tokens, grid)
    with pytest.raises(ValueError, match="P=3 prefix tokens"):
        block(tokens, (3, 5))  # a grid that does not fit the tokens


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", [(512, 2), (2, 512)])
@pytest.mark.parametrize("name", ["ssog", "ssog-steered"])
def test_half_precision_mixers_match_float32_at_a_grid_side_of_512(name, grid, dtype):
    torch.manual_seed(0)
    mixer = create_mixer(name, 16, 2, gate_init=-2.0) if name == "ssog-steered" else create_mixer(name, 16, 2)
    with torch.no_grad():  # a field and steering that reach far along both axes
        mixer.mu.normal_(0.0, 8.0)
        mixer.rho.fill_(2.0)
        for path in mixer.steer:
            getattr(mixer, f"{path}_steer").weight.normal_(0.0, 0.3)
    x = torch.randn(1, 1 + grid[0] * grid[1], 16)
    with torch.no_grad():
        want = mixer(x, grid=grid, num_prefix_tokens=1)
        got = mixer.to(dtype)(x.to(dtype), grid=grid, num_prefix_tokens=1)
    assert got.dtype == dtype
    assert _relative_error(got, want) < 1e-2


def test_kernels_are_built_in_float32_for_half_precision_fields():
    mu = torch.tensor([300.25], dtype=torch.bfloat16)
    k = ops.axis_kernels(600, mu, torch.ones(1, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.bfloat16))
    assert k.dtype == torch.float32
    one = torch.ones(1, dtype=torch.float64)
    want = ops.axis_kernels(600, mu.double(), one, one[0])
    torch.testing.assert_close(k.double(), want, rtol=0, atol=1e-6)
    assert ops.axis_kernels(4, mu.double(), one, torch.tensor(1.0)).dtype == torch.float64


# -- ssogify: faithful or refused ------------------------------------------------------------------------------------


def tiny_vit(name: str = "vit_tiny_patch16_224", **kw):
    return timm.create_model(name, num_classes=10, img_size=64, depth=2, **kw)


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("proj_bias", [False, True])
def test_ssogify_carries_every_bias_exactly_as_the_attention_had_it(qkv_bias, proj_bias):
    model = tiny_vit(qkv_bias=qkv_bias, proj_bias=proj_bias, proj_drop_rate=0.1)
    old = [(b.attn.qkv, b.attn.proj) for b in model.blocks]
    ssogvit.ssogify(model)
    d = model.embed_dim
    for (qkv, proj), block in zip(old, model.blocks):
        attn = block.attn
        assert isinstance(attn, TimmSSoGAttention)
        assert (attn.v.bias is None) == (not qkv_bias) and (attn.proj.bias is None) == (not proj_bias)
        assert torch.equal(attn.v.weight, qkv.weight[2 * d:]) and torch.equal(attn.proj.weight, proj.weight)
        if qkv_bias:
            assert torch.equal(attn.v.bias, qkv.bias[2 * d:])
        if proj_bias:
            assert torch.equal(attn.proj.bias, proj.bias)
        assert attn.proj_drop.p == 0.1
    # the swapped layer computes exactly proj(mix(v(x))) with those weights: compare with a mixer built by hand
    block = model.blocks[0]
    x = torch.randn(2, 1 + 16, d)
    ref = create_mixer("ssog", d, block.attn.num_heads, bias=qkv_bias, proj_bias=proj_bias).eval()
    ref.load_state_dict(block.attn.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(block.attn.eval()(x, grid=(4, 4)), ref(x, grid=(4, 4)), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name, kw, reason",
    [
        ("eva02_tiny_patch14_224", {}, "rotary position embedding"),
        ("vit_small_patch16_rope_224", {}, "rotary position embedding"),
        ("beit_base_patch16_224", {"embed_dim": 64, "num_heads": 2}, "relative position bias"),
        ("beit_base_patch16_224", {"embed_dim": 64, "num_heads": 2}, "separate q/v biases"),
        ("vit_relpos_small_patch16_224", {"embed_dim": 64, "num_heads": 2}, "relative position bias"),
        ("beit3_base_patch16_224", {"embed_dim": 64, "num_heads": 2}, "a norm inside the attention"),
        ("vit_tiny_patch16_224", {"scale_attn_norm": True}, "a norm inside the attention"),
        ("vit_tiny_patch16_224", {"patch_drop_rate": 0.1}, "patch dropout"),
    ],
)
def test_ssogify_refuses_what_it_cannot_carry_and_changes_nothing(name, kw, reason):
    model = timm.create_model(name, num_classes=10, depth=1, **kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attn_type = type(model.blocks[0].attn)
    with pytest.raises(ValueError, match=f"cannot reproduce this {type(model).__name__} faithfully.*{reason}"):
        ssogvit.ssogify(model)
    assert type(model.blocks[0].attn) is attn_type
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.patch_embed._forward_hooks


def test_ssogify_refuses_an_unknown_attention_class_and_blocks_without_attention():
    model = tiny_vit()

    class MyAttention(type(model.blocks[0].attn)):
        pass

    model.blocks[1].attn.__class__ = MyAttention
    with pytest.raises(ValueError, match=r"block 1 \(MyAttention\): an attention class ssogify does not know"):
        ssogvit.ssogify(model)
    del model.blocks[1].attn
    with pytest.raises(ValueError, match=r"block 1 \(Block\): no .attn to replace"):
        ssogvit.ssogify(model)


def test_ssogify_refuses_options_it_carries_over():
    with pytest.raises(ValueError, match="carries 'bias' over"):
        ssogvit.ssogify(tiny_vit(), bias=False)


def test_ssogified_model_rejects_tokens_that_do_not_fit_its_prefix_count():
    model = tiny_vit(reg_tokens=2).eval()
    ssogvit.ssogify(model)
    model(torch.randn(1, 3, 64, 64))  # records the grid (4, 4); 3 prefix tokens
    with pytest.raises(ValueError, match="P=3 prefix tokens"):
        model.blocks[0].attn(torch.randn(1, 2 + 16, 192))


def test_float16_fixed_mixer_matches_float32_where_float16_positions_stop_being_integers():
    mixer = create_mixer("ssog", 8, 1, num_atoms=1)
    with torch.no_grad():
        mixer.mu.fill_(0.4)
    x = torch.randn(1, 1 + 4096, 8)
    with torch.no_grad():
        want = mixer(x, grid=(1, 4096))
        got = mixer.half()(x.half(), grid=(1, 4096))
    assert _relative_error(got, want) < 1e-2


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
def test_ssogify_converts_each_shared_block_of_our_own_families_once(family):
    model = ssogvit.create_model(f"{family}-tiny-mha", embed_dim=32, num_heads=2, depth=3, img_size=16, patch_size=4,
                                 num_classes=3).eval()
    qkv = {id(b): b.attn.qkv.weight.detach().clone() for b in ssogvit.timm_compat.unique_blocks(model)}
    assert len(qkv) == (3 if family == "vit" else 1)
    ssogvit.ssogify(model)
    for block in ssogvit.timm_compat.unique_blocks(model):
        assert isinstance(block.attn, TimmSSoGAttention)
        assert torch.equal(block.attn.v.weight, qkv[id(block)][64:])
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 3)
