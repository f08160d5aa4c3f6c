"""Issue 33: ssogvit's timm names behave like the backbones users have: timm's own model checks on every registered
tiny name, timm's factory keywords, your own weights into any name and into smp, save_pretrained replacing a saved
folder, and smp's architectures on the pyramid (docs/dense.md, docs/models.md)."""

import math
import os

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models import FeatureInfo

import ssogvit
from ssogvit.models import create_model, create_segmentation_model, list_models, load_weights, timm_name
from ssogvit.models.pretrained import carry_state_dict
from ssogvit.train.io import export_safetensors, load_model

CHEAP = dict(img_size=32, patch_size=8, embed_dim=24, depth=3)
PYRAMID = dict(CHEAP, pyramid_dim=8)
FIVE = dict(CHEAP, depth=5)  # timm's features_only takes block applications 0..4 by default
TINY_NAMES = [timm_name(n) + kind for n in list_models("*-tiny-*") for kind in ("", "_pyramid")]
#: the default run's share of the registry: each family, both kinds, an SSoG and an attention mixer
DEFAULT_NAMES = {"ssogvit_vit_tiny_ssog", "ssogvit_vit_tiny_ssog_pyramid", "ssogvit_looped_tiny_ssog_steered_pyramid",
                 "ssogvit_ode_tiny_mha_pyramid"}


def _finite_maps(maps, channels, reductions, size):
    """timm's checks of feature maps: channels, spatial sides at most ceil(side / reduction) + 1, batch, no NaN."""
    assert len(maps) == len(channels) >= 3
    for m, c, r in zip(maps, channels, reductions):
        assert m.shape[0] == 1 and m.shape[1] == c and not torch.isnan(m).any()
        assert m.shape[2] <= math.ceil(size[0] / r) + 1 and m.shape[3] <= math.ceil(size[1] / r) + 1


def timm_model_checks(name: str, **kw) -> None:
    """What timm's tests/test_models.py checks of a registered model (forward, backward, default cfgs, forward
    intermediates, features_only), on the model built at cheap sizes. Classifier names are ViTs and get the checks
    timm gives its own vit_* (tokens out of forward_features); pyramid names get those of a CNN (a map of pool_size)."""
    pyramid = name.endswith("_pyramid")
    model = timm.create_model(name, **kw).eval()
    cfg = model.default_cfg
    size = cfg["input_size"]
    assert tuple(size) == (3, 32, 32) and cfg["fixed_input_size"] is False
    x = torch.randn(1, *size)
    out = model(x)  # test_model_forward
    assert out.shape == (1, cfg["num_classes"]) and not torch.isnan(out).any()
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-5)
    model.set_grad_checkpointing(False)
    trained = timm.create_model(name, num_classes=42, **kw).train()  # test_model_backward
    y = trained(torch.randn(2, *size))
    y.mean().backward()
    assert y.shape[-1] == 42 and all(p.grad is not None for p in trained.parameters())
    state = model.state_dict()  # test_model_default_cfgs: names, widths, heads
    for key in (cfg["classifier"], cfg["first_conv"]):
        assert key + ".weight" in state
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    feats = model.forward_features(x)
    pre = model.forward_head(feats, pre_logits=True)
    if pyramid:
        assert feats.ndim == 4 and feats.shape[2:] == tuple(cfg["pool_size"]) and feats.shape[1] == model.num_features
    else:
        assert feats.ndim == 3 and feats.shape[-1] == model.num_features
    assert pre.shape == (1, model.head_hidden_size)
    model.reset_classifier(0)
    assert model.num_classes == 0 and model(x).shape == pre.shape
    if pyramid:
        model.reset_classifier(0, "")
        assert model(x).shape[2:] == tuple(cfg["pool_size"])
        bare = timm.create_model(name, num_classes=0, global_pool="", **kw).eval()
        assert bare(x).shape[2:] == tuple(cfg["pool_size"])
    else:
        assert timm.create_model(name, num_classes=0, **kw).eval()(x).shape[-1] == model.num_features
    fresh = timm.create_model(name, **kw).eval()  # test_model_forward_intermediates
    info = FeatureInfo(fresh.feature_info, len(fresh.feature_info))
    final, maps = fresh.forward_intermediates(x, output_fmt="NCHW")
    _finite_maps(maps, info.channels(), info.reduction(), size[1:])
    torch.testing.assert_close(final, fresh.forward_features(x))
    fresh.set_grad_checkpointing()
    torch.testing.assert_close(fresh.forward_intermediates(x, output_fmt="NCHW")[0], final, rtol=1e-4, atol=1e-5)
    features = timm.create_model(name, features_only=True, **kw).eval()  # test_model_forward_features
    _finite_maps(features(x), features.feature_info.channels(), features.feature_info.reduction(), size[1:])


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT_NAMES else [pytest.mark.slow])
                                  for n in TINY_NAMES])
def test_timms_model_checks_hold_on_every_registered_tiny_name(name):
    timm_model_checks(name, **(PYRAMID if name.endswith("_pyramid") else FIVE))


def test_a_pyramid_name_is_a_classifier_whose_features_are_the_levels():
    model = timm.create_model("ssogvit_vit_tiny_ssog_pyramid", num_classes=5, **PYRAMID).eval()
    x = torch.randn(2, 3, 32, 48)
    levels = model.forward_intermediates(x, intermediates_only=True)
    assert [tuple(t.shape) for t in levels] == [(2, 8, 16, 24), (2, 8, 8, 12), (2, 8, 4, 6), (2, 8, 2, 3)]
    merged = sum(F.adaptive_avg_pool2d(m, (2, 3)) for m in levels)  # what the classifier reads: every level
    torch.testing.assert_close(model.forward_features(x), merged)
    torch.testing.assert_close(model(x), model.head.fc(merged.mean((2, 3))))
    assert model(x).shape == (2, 5)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT_NAMES else [pytest.mark.slow])
                                  for n in TINY_NAMES])
def test_timm_factory_keywords_reach_every_parameter_of_every_registered_tiny_name(name):
    model = timm.create_model(name, device="meta", dtype=torch.bfloat16, dynamic_img_size=True)  # shapes only
    tensors = [*model.parameters(), *model.buffers()]
    assert {(t.device.type, t.dtype) for t in tensors if t.is_floating_point()} == {("meta", torch.bfloat16)}
    with pytest.raises(ValueError, match="dtype must be a floating"):
        timm.create_model(name, dtype=torch.int64)


@pytest.mark.parametrize("name", ["ssogvit_looped_tiny_ssog", "ssogvit_vit_tiny_ssog_steered_pyramid"])
def test_dynamic_img_pad_pads_what_the_patch_does_not_divide_as_timm_does(name):
    kw = PYRAMID if name.endswith("_pyramid") else CHEAP
    model = timm.create_model(name, dynamic_img_pad=True, dynamic_img_size=True, **kw).eval()
    x = torch.randn(1, 3, 35, 29)
    with torch.no_grad():  # timm's PatchEmbed pads right and bottom with zeros to the next multiple of the patch
        torch.testing.assert_close(model(x), model(F.pad(x, (0, 3, 0, 5))))
    if not name.endswith("_pyramid"):
        assert model.config["dynamic_img_pad"] is True and create_model(**model.config).config == model.config
    with pytest.raises(ValueError, match="dynamic_img_pad=True pads it"):
        timm.create_model(name, **kw).eval()(x)


# -- your own weights ------------------------------------------------------------------------------------------------


def _same(state, prefix, into):
    return all(torch.equal(v, into[prefix + k]) for k, v in state.items() if not k.startswith("head."))


def test_an_export_loads_into_the_pyramid_its_features_and_smp_through_timms_file_overlay(tmp_path):
    smp = pytest.importorskip("segmentation_models_pytorch")
    model = create_model("vit-tiny-ssog", num_classes=10, **CHEAP)
    file = export_safetensors(model, tmp_path / "model.safetensors")
    own = model.state_dict()
    overlay = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(file)))
    pyramid = timm.create_model("ssogvit_vit_tiny_ssog_pyramid", pyramid_dim=8, num_classes=3, **overlay)
    assert _same(own, "backbone.", pyramid.state_dict()) and pyramid.backbone.config["depth"] == 3
    features = timm.create_model("ssogvit_vit_tiny_ssog_pyramid", features_only=True, pyramid_dim=8, **overlay)
    assert _same(own, "model.backbone.", features.state_dict())
    net = smp.FPN("tu-ssogvit_vit_tiny_ssog_pyramid", encoder_weights=True, classes=2, pyramid_dim=8,
                  pretrained_cfg_overlay=dict(file=str(file)))
    assert _same(own, "encoder.model.model.backbone.", net.state_dict())
    with pytest.raises(ValueError, match="holds weights of 'vit-tiny-ssog', not of 'vit-tiny-mha'"):
        timm.create_model("ssogvit_vit_tiny_mha_pyramid", **overlay)


@pytest.mark.parametrize("name", ["ssogvit_vit_tiny_ssog", "ssogvit_vit_tiny_ssog_pyramid"])
def test_a_keyword_that_contradicts_the_weights_file_is_refused_before_building(name, tmp_path):
    """The audit's A35/A39/B07: a keyword that the file's config fixes otherwise is named in one line with both
    values (not torch's wall of missing keys); what the carried weights leave free (`FILE_MAY_DIFFER`) may differ."""
    from ssogvit.errors import InputError

    file = export_safetensors(create_model("vit-tiny-ssog", num_classes=10, **CHEAP), tmp_path / "model.safetensors")
    overlay = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(file)))
    for key, value, saved in (("depth", 2, 3), ("embed_dim", 48, 24), ("patch_size", 4, 8)):
        with pytest.raises(InputError, match=rf"^{key}={value} contradicts .*model.safetensors, whose weights were "
                                             rf"built with {key}={saved}: leave {key} out"):
            timm.create_model(name, **overlay, **{key: value})
    model = timm.create_model(name, **overlay, depth=3, num_classes=4, img_size=48)  # the same depth, a new head
    assert getattr(model, "backbone", model).config["depth"] == 3


def test_a_segmentation_export_carries_its_pyramid_and_load_weights_fills_a_built_network(tmp_path):
    smp = pytest.importorskip("segmentation_models_pytorch")
    wide = dict(img_size=32, patch_size=8, embed_dim=24)  # smp's `depth` is its own: the backbone keeps its 12 blocks
    seg = create_segmentation_model("vit-tiny-ssog-steered", num_classes=3, pyramid_dim=8, head_dim=8, **wide)
    file = export_safetensors(seg, tmp_path / "seg.safetensors")
    pyramid = timm.create_model("ssogvit_vit_tiny_ssog_steered_pyramid", pretrained=True,
                                pretrained_cfg_overlay=dict(file=str(file)))
    features = {k[len("features."):]: v for k, v in seg.state_dict().items() if k.startswith("features.")}
    assert _same(features, "", pyramid.state_dict())
    x = torch.randn(1, 3, 32, 48)
    with torch.no_grad():
        for got, want in zip(pyramid.eval().forward_intermediates(x, intermediates_only=True), seg.eval().features(x)):
            torch.testing.assert_close(got, want)
    net = smp.Unet("tu-ssogvit_vit_tiny_ssog_steered_pyramid", encoder_weights=None, classes=2, pyramid_dim=8, **wide)
    load_weights(net, file)  # a network built first, then the one documented line
    assert _same(features, "encoder.model.model.", net.state_dict())
    other = smp.Unet("tu-ssogvit_vit_tiny_ssog_steered_pyramid", encoder_weights=None, classes=2, pyramid_dim=8,
                     img_size=32, patch_size=8, embed_dim=48)
    with pytest.raises(ValueError, match="does not fit the vit-tiny-ssog-steered model built here"):
        load_weights(other, file)  # width 48 built, 24 in the file


def test_a_timm_vit_on_disk_becomes_an_ssog_pyramid_carried_as_ssogify_carries_it(tmp_path):
    vit = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, dynamic_img_size=True).eval()
    torch.save(vit.state_dict(), tmp_path / "vit_tiny.pth")
    pyramid = timm.create_model("ssogvit_vit_tiny_ssog_pyramid", pretrained=True, img_size=64, depth=2,
                                pretrained_cfg_overlay=dict(file=str(tmp_path / "vit_tiny.pth"))).eval()
    carried = carry_state_dict(torch.load(tmp_path / "vit_tiny.pth"), pyramid)
    assert carried.keys() == pyramid.state_dict().keys() and not any(".qkv." in k for k in carried)
    ssogvit.ssogify(vit)
    fields = {k: v for k, v in pyramid.backbone.state_dict().items() if ".attn." in k and "." + k.split(".")[-1]
              not in (".weight", ".bias")}
    vit.load_state_dict(fields, strict=False)  # the same fields; everything else carried from the file
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        torch.testing.assert_close(pyramid.backbone.forward_features(x), vit.forward_features(x))


# -- save_pretrained and the folder it writes ------------------------------------------------------------------------


def test_save_pretrained_replaces_a_saved_folder_atomically_and_refuses_anything_else(tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    first, second = (create_model("vit-tiny-ssog", num_classes=3, **CHEAP) for _ in range(2))
    first.save_pretrained(folder)
    second.save_pretrained(folder)  # the README's example, run twice
    assert sorted(os.listdir(tmp_path)) == ["saved"] and sorted(os.listdir(folder)) == ["config.json",
                                                                                        "model.safetensors"]
    assert _same(second.state_dict(), "", load_model(folder).state_dict())
    import ssogvit.models._common as common

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(common, "seal_file", broken)
    with pytest.raises(OSError, match="disk full"):
        first.save_pretrained(folder)
    assert sorted(os.listdir(tmp_path)) == ["saved"] and _same(second.state_dict(), "", load_model(folder).state_dict())
    monkeypatch.undo()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for target, match in ((tmp_path / "notes", "holds todo.txt"), (tmp_path / "file", "is not a folder")):
        with pytest.raises(FileExistsError, match=match):
            first.save_pretrained(target)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"


def test_export_and_load_model_take_a_save_pretrained_folder(tmp_path):
    from ssogvit.export import main as export_main

    model = create_model("vit-tiny-ssog", num_classes=3, **CHEAP).eval()
    model.save_pretrained(tmp_path / "saved")
    assert _same(model.state_dict(), "", load_model(tmp_path / "saved").state_dict())
    argv = ["--ckpt", str(tmp_path / "saved"), "--format", "torchscript", "--out", str(tmp_path / "m.pt")]
    assert export_main(argv) == 0 and (tmp_path / "m.pt").is_file()


# -- segmentation_models_pytorch -------------------------------------------------------------------------------------

#: every smp architecture that takes a timm encoder, and the output stride it asks for
SMP_ARCHS = {"Unet": 32, "UnetPlusPlus": 32, "MAnet": 32, "Linknet": 32, "FPN": 32, "PSPNet": 8, "DeepLabV3": 8,
             "DeepLabV3Plus": 16, "PAN": 16, "UPerNet": 32, "Segformer": 32, "DPT": None}
SMP_DEFAULT = {("DeepLabV3Plus", "vit", "ssog")}


@pytest.mark.parametrize("arch, family, mixer", [
    pytest.param(a, f, m, marks=[] if (a, f, m) in SMP_DEFAULT else [pytest.mark.slow])
    for a in SMP_ARCHS for f in ("vit", "looped", "ode") for m in ("ssog", "ssog-steered", "mha")])
def test_every_smp_architecture_takes_the_pyramid_on_a_rectangular_image(arch, family, mixer):
    smp = pytest.importorskip("segmentation_models_pytorch")
    name = timm_name(f"{family}-tiny-{mixer}") + ("" if arch == "DPT" else "_pyramid")  # DPT reads ViT blocks
    kw = dict(embed_dim=24) if arch == "DPT" else dict(embed_dim=24, pyramid_dim=16)
    net = getattr(smp, arch)(f"tu-{name}", encoder_weights=None, classes=3, **kw).eval()
    x = torch.randn(1, 3, 128, 192)  # PAN's attention pools its coarsest map three times: at least 128 px
    with torch.no_grad():
        out = net(x)
    assert out.shape == (1, 3, 128, 192) and torch.isfinite(out).all()
    stride = SMP_ARCHS[arch]
    if stride is not None and arch != "PSPNet":  # PSPNet reads 3 levels; the others the 4 levels at their stride
        assert net.encoder.model.feature_info.reduction() == [min(r, stride) for r in (4, 8, 16, 32)]


def test_output_stride_resamples_the_coarse_levels_instead_of_pooling_them():
    for stride, reductions in ((8, [4, 8, 8, 8]), (16, [4, 8, 16, 16]), (32, [4, 8, 16, 32])):
        features = timm.create_model("ssogvit_ode_tiny_ssog_pyramid", features_only=True, output_stride=stride,
                                     embed_dim=24, depth=2, pyramid_dim=8)
        assert features.feature_info.reduction() == reductions
        maps = features(torch.randn(1, 3, 64, 96))
        assert [tuple(m.shape[2:]) for m in maps] == [(64 // r, 96 // r) for r in reductions]
