"""Dense prediction (docs/dense.md): the pyramid and head on every family and mixer, timm's features_only view,
segmentation_models_pytorch's decoders on it, and the bad inputs it refuses."""

from __future__ import annotations

import pytest
import timm
import torch

from ssogvit.layers import list_mixers
from ssogvit.models import create_model, create_segmentation_model, list_models

TINY = dict(embed_dim=16, num_heads=2, depth=2, in_chans=1, pyramid_dim=8, head_dim=8)


def seg(name: str = "vit-tiny-ssog", **kw) -> torch.nn.Module:
    return create_segmentation_model(name, num_classes=5, img_size=32, patch_size=8, **{**TINY, **kw})


@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
@pytest.mark.parametrize("mixer", list_mixers())
def test_pyramid_strides_and_logits_at_input_size_on_a_rectangular_image(family, mixer):
    model = seg(f"{family}-tiny-{mixer}").eval()
    x = torch.randn(2, 1, 32, 48)  # a 4x6 grid of 8 px patches: never square-rooted
    levels = model.features(x)
    assert [tuple(t.shape) for t in levels] == [(2, 8, 16, 24), (2, 8, 8, 12), (2, 8, 4, 6), (2, 8, 2, 3)]
    assert model(x).shape == (2, 5, 32, 48)


def test_the_loss_trains_the_mixers_through_pyramid_and_head():
    model = seg("vit-tiny-ssog-steered")
    x, y = torch.randn(2, 1, 32, 32), torch.randint(0, 5, (2, 32, 32))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for mixer in model.mixers():
        grads = [p.grad for p in mixer.parameters() if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(float(g.abs().sum()) > 0 for g in grads)


def test_intermediate_blocks_feed_one_level_each():
    model = seg(depth=4, feature_blocks=[0, 1, 2, 3]).eval()
    x = torch.randn(1, 1, 32, 32)
    maps = model.backbone.forward_intermediates(x, indices=[0, 1, 2, 3], norm=True, intermediates_only=True)
    expected = [level(m) for level, m in zip(model.features.pyramid.levels, maps)]
    for got, want in zip(model.features(x), expected):
        torch.testing.assert_close(got, want)
    last = seg(depth=4).eval()
    last.load_state_dict(model.state_dict())
    assert not torch.allclose(last(x), model(x))  # the last block's map alone gives another answer


def test_config_rebuilds_the_model_and_its_weights_load():
    model = seg(feature_blocks=[0, 0, 1, 1])
    assert model.config["task"] == "segmentation"
    again = create_model(**model.config)
    again.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(1, 1, 32, 32)
    torch.testing.assert_close(again.eval()(x), model.eval()(x))


def test_timm_features_only_reports_strides_4_to_32_at_patch_16():
    features = timm.create_model("ssogvit_vit_tiny_ssog_pyramid", features_only=True, in_chans=1, embed_dim=16,
                                 num_heads=2, depth=1, pyramid_dim=8, out_indices=(1, 3))
    assert features.feature_info.reduction() == [8, 32] and features.feature_info.channels() == [8, 8]
    assert [tuple(t.shape) for t in features(torch.randn(1, 1, 64, 96))] == [(1, 8, 8, 12), (1, 8, 2, 3)]
    assert set(timm.list_models("ssogvit_*_pyramid")) == {f"ssogvit_{n.replace('-', '_')}_pyramid" for n in
                                                           list_models()}


@pytest.mark.parametrize("arch", ["Unet", "FPN", "UPerNet"])
def test_segmentation_models_pytorch_decoders_accept_the_pyramid(arch):
    smp = pytest.importorskip("segmentation_models_pytorch")
    net = getattr(smp, arch)("tu-ssogvit_vit_tiny_ssog_pyramid", encoder_weights=None, in_channels=1, classes=3)
    x = torch.randn(1, 1, 64, 64)
    out = net.eval()(x)
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="Unsupported model downsampling pattern"):  # why the pyramid is needed
        getattr(smp, arch)("tu-ssogvit_vit_tiny_ssog", encoder_weights=None, in_channels=1, classes=3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(feature_blocks=[0, 1]), "one block per pyramid level"),
    (dict(feature_blocks=[0, 1, 2, 9]), "has 2 block applications"),
    (dict(pyramid_dim=0), "pyramid_dim=0"),
    (dict(embed_dim=2, num_heads=1), "width of at least 4"),
])
def test_bad_options_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        seg(**kwargs)


def test_an_image_the_patch_does_not_divide_and_an_unknown_task_are_refused():
    with pytest.raises(ValueError, match="not divisible by the patch size 8"):
        seg()(torch.randn(1, 1, 36, 32))
    with pytest.raises(ValueError, match="unknown task 'detection'"):
        create_model("vit-tiny-ssog", task="detection")
    with pytest.raises(ValueError, match=r"output_stride=12: the pyramid of patch 16 has reductions \[4, 8, 16, 32\]"):
        timm.create_model("ssogvit_vit_tiny_ssog_pyramid", output_stride=12)
