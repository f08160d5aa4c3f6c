"""Dense prediction on a ViT backbone (docs/dense.md): ViTDet's simple feature pyramid and a semantic-FPN head.

The backbone is any model of ours (any family, any registered mixer): the pyramid reads its patch maps through
timm's ``forward_intermediates`` (the grid passed to every block), so nothing here knows which mixer it holds.

- ``SimpleFeaturePyramid`` (Li et al., ViTDet): one stride-``p`` map (or one map per level, from intermediate
  blocks) -> maps at strides ``p/4, p/2, p, 2p`` (4, 8, 16, 32 for patch 16): two 2x2 deconvolutions, one, none, a
  2x2 max-pool; then a 1x1 and a 3x3 convolution with LayerNorm on each level (timm's ``ConvNormAct`` and
  ``LayerNorm2d``: the model needs nothing beyond the core's torch and timm).
- ``PyramidFeatures``: backbone + pyramid, the features of ``SegmentationModel``.
- ``PyramidViT``: backbone + pyramid + a classifier on the pyramid, a whole timm model registered as
  ``ssogvit_<family>_<size>_<mixer>_pyramid``: ``forward_intermediates`` and ``features_only=True`` give the levels
  (reductions ``p/4 .. 2p``, or capped at ``output_stride`` by resampling), so segmentation_models_pytorch takes
  ``tu-ssogvit_vit_tiny_ssog_pyramid`` as the encoder of every architecture that takes a timm encoder.
- ``SemanticFPNHead`` (Kirillov et al., Panoptic FPN's semantic branch, one conv per level): each level to
  ``head_dim`` channels, upsampled to the finest level and summed, a 1x1 classifier, bilinear upsampling to the input.
- ``SegmentationModel``: features + head, logits ``(B, num_classes, H, W)`` at the input resolution.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.nn.functional as F
from timm.layers import ClassifierHead, ConvNormAct, LayerNorm2d
from timm.models import FeatureInfo
from torch import Tensor, nn

from ssogvit.errors import InputError, UsageError
from ssogvit.specs import EMBED_DIM, Int, Ints, checked

from ._common import VisionTransformerBase, feature_take_indices  # timm's private helper, imported in one place

__all__ = ["PYRAMID_SCALES", "SimpleFeaturePyramid", "PyramidFeatures", "PyramidViT", "SemanticFPNHead",
           "SegmentationModel", "check_pyramid_patch", "pyramid_scales"]

#: upsampling factor of each pyramid level relative to the patch map (ViTDet: strides 4, 8, 16, 32 at patch 16)
PYRAMID_SCALES: tuple[float, ...] = (4.0, 2.0, 1.0, 0.5)
NUM_LEVELS = len(PYRAMID_SCALES)


def _resample(dim: int, scale: float) -> tuple[nn.Module, int]:
    """ViTDet's resampling of one level: ``(B, dim, Gh, Gw) -> (B, c, scale*Gh, scale*Gw)`` and its width ``c``."""
    if scale == 4.0:
        return nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), LayerNorm2d(dim // 2), nn.GELU(),
                             nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2)), dim // 4
    if scale == 2.0:
        return nn.ConvTranspose2d(dim, dim // 2, 2, stride=2), dim // 2
    if scale == 1.0:
        return nn.Identity(), dim
    if scale == 0.5:
        return nn.MaxPool2d(2, ceil_mode=True), dim
    raise ValueError(f"unsupported pyramid scale {scale}; ViTDet's are {PYRAMID_SCALES}")


def check_pyramid_patch(patch_size: int) -> None:
    """Refuse a backbone patch the pyramid cannot take: its finest level is at stride ``patch_size / 4``, and timm's
    ``FeatureInfo`` takes reductions of 1 pixel or more."""
    if patch_size < 4:
        raise InputError(f"patch_size={patch_size}: the feature pyramid's finest level is at stride patch_size/4, so "
                         "a pyramid backbone takes patch_size >= 4", argument="patch_size")


def pyramid_scales(patch_size: int, output_stride: int | None = None) -> tuple[float, ...]:
    """Each level's upsampling factor over the patch map: ViTDet's, with every level's reduction capped at
    ``output_stride`` (the coarse levels resampled to that stride instead of pooled: what DeepLab's dilation gives a
    CNN, docs/dense.md). ``output_stride`` must be one of the pyramid's reductions ``p/4, p/2, p, 2p``."""
    if output_stride is None:
        return PYRAMID_SCALES
    reductions = [patch_size / s for s in PYRAMID_SCALES]
    if output_stride not in reductions:
        whole = [int(r) if float(r).is_integer() else r for r in reductions]
        raise ValueError(f"output_stride={output_stride}: the pyramid of patch {patch_size} has reductions {whole}; "
                         "give one of them")
    return tuple(max(s, patch_size / output_stride) for s in PYRAMID_SCALES)


def _feature_info(patch_size: int, scales: tuple[float, ...], width: int) -> list[dict[str, Any]]:
    """timm's ``feature_info`` of the levels; whole reductions as ints (timm and smp compare them with ``2 ** k``)."""
    reductions = [patch_size / s for s in scales]
    return [dict(num_chs=width, reduction=int(r) if r.is_integer() else r, module=f"pyramid.levels.{i}")
            for i, r in enumerate(reductions)]


def _check_feature_blocks(backbone: VisionTransformerBase, feature_blocks: list[int] | None) -> list[int] | None:
    if feature_blocks is not None and max(feature_blocks) >= len(backbone.blocks):
        raise InputError(f"feature_blocks={list(feature_blocks)}: the backbone has {len(backbone.blocks)} block "
                         f"applications (0..{len(backbone.blocks) - 1})", argument="feature_blocks")
    return None if feature_blocks is None else [int(i) for i in feature_blocks]


def _patch_maps(backbone: VisionTransformerBase, x: Tensor, feature_blocks: list[int] | None) -> list[Tensor]:
    """The normalised patch maps ``(B, D, Gh, Gw)`` the pyramid reads: the last block's (ViTDet), or one per level."""
    blocks = [-1] if feature_blocks is None else feature_blocks
    taken = sorted({b % len(backbone.blocks) for b in blocks})
    maps = backbone.forward_intermediates(x, indices=taken, norm=True, output_fmt="NCHW", intermediates_only=True)
    by_block = dict(zip(taken, maps))
    return [by_block[b % len(backbone.blocks)] for b in blocks]


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid on ViT patch maps.

    Args:
        in_channels: width ``D`` of the patch maps (at least 4: the stride-``p/4`` level has ``D // 4`` channels
            before its projection).
        out_channels: width of every level.
    """

    def __init__(self, in_channels: int, out_channels: int, scales: tuple[float, ...] = PYRAMID_SCALES) -> None:
        super().__init__()
        if in_channels < 4:
            raise InputError(f"the pyramid needs a backbone width of at least 4, got {in_channels}",
                             argument="embed_dim")
        levels = []
        for scale in scales:
            resample, width = _resample(in_channels, scale)
            levels.append(nn.Sequential(
                resample,
                ConvNormAct(width, out_channels, 1, norm_layer=LayerNorm2d, apply_act=False),
                ConvNormAct(out_channels, out_channels, 3, norm_layer=LayerNorm2d, apply_act=False),
            ))
        self.levels = nn.ModuleList(levels)

    def forward(self, maps: list[Tensor]) -> list[Tensor]:
        """One map ``(B, D, Gh, Gw)`` for every level, or one per level -> ``NUM_LEVELS`` maps, finest first."""
        if len(maps) == 1:
            maps = maps * NUM_LEVELS
        if len(maps) != NUM_LEVELS:
            raise ValueError(f"the pyramid takes 1 or {NUM_LEVELS} maps, got {len(maps)}")
        return [level(m) for level, m in zip(self.levels, maps)]


class PyramidFeatures(nn.Module):
    """A ViT backbone and its simple feature pyramid: images -> maps at reductions ``p/4, p/2, p, 2p``.

    A timm ``features_only`` model: ``feature_info`` (timm's ``FeatureInfo``) gives each level's channels and
    reduction; ``out_indices`` selects the levels returned.

    Args:
        backbone: an ssogvit model (its head is not used).
        pyramid_dim: width of every pyramid level.
        feature_blocks: ``None``: every level from the last block's map (ViTDet); or one block index per level
            (finest first), each level from that block's map.
        out_indices: the levels ``forward`` returns.
    """

    def __init__(self, backbone: VisionTransformerBase, *, pyramid_dim: int, feature_blocks: list[int] | None = None,
                 out_indices: tuple[int, ...] = tuple(range(NUM_LEVELS))) -> None:
        super().__init__()
        feature_blocks = _check_feature_blocks(backbone, feature_blocks)
        bad = [i for i in out_indices if not 0 <= int(i) < NUM_LEVELS]
        if bad or not out_indices:
            raise InputError(f"out_indices={tuple(out_indices)}: the pyramid has levels 0..{NUM_LEVELS - 1}",
                             argument="out_indices")
        check_pyramid_patch(backbone.patch_size)
        self.backbone = backbone
        self.pyramid = SimpleFeaturePyramid(backbone.embed_dim, pyramid_dim)
        self.feature_blocks = feature_blocks
        self.out_indices = tuple(int(i) for i in out_indices)
        self.feature_info = FeatureInfo(_feature_info(backbone.patch_size, PYRAMID_SCALES, pyramid_dim),
                                        self.out_indices)

    def forward(self, x: Tensor) -> list[Tensor]:
        """Images ``(B, C, H, W)`` (sides divisible by the patch) -> the ``out_indices`` levels, finest first."""
        levels = self.pyramid(_patch_maps(self.backbone, x, self.feature_blocks))
        return [levels[i] for i in self.out_indices]


class PyramidViT(nn.Module):
    """A whole timm model on the simple feature pyramid: backbone, pyramid and a classifier on the pyramid.

    ``timm.create_model("ssogvit_<family>_<size>_<mixer>_pyramid")`` builds it. Its classifier reads every level, so
    each weight is trained by a classification loss and timm's model tests hold (docs/dense.md): ``forward_features``
    gives the levels average-pooled to the coarsest level's grid and summed, ``(B, pyramid_dim, H / r, W / r)`` with
    ``r`` the last reduction; ``forward_head`` pools it and applies the linear head (timm's ``ClassifierHead``).
    ``forward_intermediates`` gives the levels themselves, finest first, and ``features_only=True`` (timm's
    ``FeatureGetterNet``) makes it the encoder smp takes; the state-dict keys are ``PyramidFeatures``' (``backbone.*``,
    ``pyramid.*``) and ``head.*``.

    Args:
        backbone: an ssogvit model built with ``num_classes=0``.
        pyramid_dim: width of every level.
        feature_blocks: ``None``, every level from the last block's map; or one block index per level.
        num_classes: classes of the head (0: none).
        global_pool: the head's pooling (timm's ``SelectAdaptivePool2d`` names; ``""`` keeps the map).
        drop_rate: dropout before the head.
        output_stride: cap on the levels' reductions (``pyramid_scales``); ``None``: ViTDet's ``p/4 .. 2p``.
        config: the record of how it was built.
    """

    def __init__(self, backbone: VisionTransformerBase, *, pyramid_dim: Annotated[int, EMBED_DIM] = 256,
                 feature_blocks: list[int] | None = None, num_classes: int = 1000, global_pool: str = "avg",
                 drop_rate: float = 0.0, output_stride: int | None = None,
                 config: dict[str, Any] | None = None) -> None:
        super().__init__()
        if feature_blocks is not None and len(feature_blocks) != NUM_LEVELS:
            raise ValueError(f"feature_blocks={list(feature_blocks)}: give one block per pyramid level "
                             f"({NUM_LEVELS}, finest first), or none for the last block's map")
        self.feature_blocks = _check_feature_blocks(backbone, feature_blocks)
        self.backbone = backbone
        self.scales = pyramid_scales(backbone.patch_size, output_stride)
        self.pyramid = SimpleFeaturePyramid(backbone.embed_dim, pyramid_dim, self.scales)
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = pyramid_dim
        self.head = ClassifierHead(pyramid_dim, num_classes, pool_type=global_pool, drop_rate=drop_rate)
        self.feature_info = _feature_info(backbone.patch_size, self.scales, pyramid_dim)
        self.config = dict(config or {})

    @property
    def reductions(self) -> list[float]:
        """Each level's reduction of the input, finest first."""
        return [info["reduction"] for info in self.feature_info]

    def levels(self, x: Tensor, indices: list[int] | None = None) -> list[Tensor]:
        """The pyramid levels ``indices`` (default all), finest first; only those are computed."""
        maps = _patch_maps(self.backbone, x, self.feature_blocks)
        maps = maps * NUM_LEVELS if len(maps) == 1 else maps
        take = range(NUM_LEVELS) if indices is None else indices
        return [self.pyramid.levels[i](maps[i]) for i in take]

    @staticmethod
    def _merge(levels: list[Tensor]) -> Tensor:
        size = levels[-1].shape[-2:]
        return sum(F.adaptive_avg_pool2d(m, size) if m.shape[-2:] != size else m for m in levels)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images -> the levels average-pooled to the coarsest level's grid and summed ``(B, pyramid_dim, h, w)``."""
        return self._merge(self.levels(x))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """timm's: the pooled features (``pre_logits``) or the logits."""
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self, x: Tensor, indices: int | list[int] | None = None, norm: bool = False, stop_early: bool = False,
        output_fmt: str = "NCHW", intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's: the pyramid levels ``indices`` (last ``n`` if an int, all if ``None``) as ``NCHW`` maps, and
        unless ``intermediates_only`` the ``forward_features`` output first. Every level is normalised already
        (LayerNorm in each level), so ``norm`` changes nothing."""
        if output_fmt != "NCHW":
            raise ValueError(f"the pyramid's levels are NCHW maps; got output_fmt={output_fmt!r}")
        take, _ = feature_take_indices(NUM_LEVELS, indices)
        if intermediates_only:
            return self.levels(x, take)
        levels = self.levels(x)
        return self._merge(levels), [levels[i] for i in take]

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """timm's: the levels kept for ``forward_intermediates``; with ``prune_head`` the classifier goes."""
        take, _ = feature_take_indices(NUM_LEVELS, indices)
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's: a new head for ``num_classes`` (0: none), optionally another pooling (``""``: none)."""
        self.num_classes = num_classes
        self.head.reset(num_classes, pool_type=global_pool)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """The backbone's set (under ``backbone.``) and every parameter of at most one dimension."""
        inner = {f"backbone.{n}" for n in self.backbone.no_weight_decay()}
        return inner | {n for n, p in self.named_parameters() if p.ndim <= 1}

    def mixers(self) -> list[nn.Module]:
        return self.backbone.mixers()


class SemanticFPNHead(nn.Module):
    """Panoptic FPN's semantic head, light: one 3x3 conv (LayerNorm, ReLU) per level, upsampled to the finest level,
    summed, a 1x1 classifier.

    Args:
        in_channels: width of the pyramid levels.
        head_dim: width of the head.
        num_classes: output classes.
        num_levels: pyramid levels it reads.
    """

    def __init__(self, in_channels: int, head_dim: int, num_classes: int, num_levels: int = NUM_LEVELS) -> None:
        super().__init__()
        self.lateral = nn.ModuleList(
            ConvNormAct(in_channels, head_dim, 3, norm_layer=LayerNorm2d, act_layer=nn.ReLU)
            for _ in range(num_levels)
        )
        self.classifier = nn.Conv2d(head_dim, num_classes, 1)

    def forward(self, levels: list[Tensor], size: tuple[int, int]) -> Tensor:
        """Levels, finest first -> logits ``(B, num_classes, *size)``."""
        finest = levels[0].shape[-2:]
        fused = sum(F.interpolate(lat(m), size=finest, mode="bilinear", align_corners=False) if m.shape[-2:] != finest
                    else lat(m) for lat, m in zip(self.lateral, levels))
        return F.interpolate(self.classifier(fused), size=size, mode="bilinear", align_corners=False)


class SegmentationModel(nn.Module):
    """Semantic segmentation on an ssogvit backbone: ``PyramidFeatures`` + ``SemanticFPNHead``.

    Built by ``create_model(name, task="segmentation", ...)`` (``ssogvit.models.create_segmentation_model``), which
    records ``config`` so ``create_model(**model.config)`` rebuilds it. It answers what evaluation and resolution
    transfer ask of a model (``patch_size``, ``grid_size``, ``img_size``, ``set_patch_size``, ``rescale_field``,
    ``mixers``, ``no_weight_decay``, ``forward_bytes``) by asking its backbone.

    Args:
        backbone: an ssogvit model built with ``num_classes=0``.
        num_classes: classes of the per-pixel labels.
        pyramid_dim: width of the pyramid levels.
        head_dim: width of the head.
        feature_blocks: see ``PyramidFeatures``.
        config: the record of how it was built.
    """

    task = "segmentation"

    @checked
    def __init__(self, backbone: VisionTransformerBase, *, num_classes: Annotated[int, Int(1, 100_000)],
                 pyramid_dim: Annotated[int, EMBED_DIM] = 256, head_dim: Annotated[int, EMBED_DIM] = 128,
                 feature_blocks: Annotated[list[int] | None, Ints(Int(0, 1023), min_len=1, none=True)] = None,
                 config: dict[str, Any] | None = None) -> None:
        super().__init__()
        if feature_blocks is not None and len(feature_blocks) != NUM_LEVELS:
            raise InputError(f"feature_blocks={list(feature_blocks)}: give one block per pyramid level "
                             f"({NUM_LEVELS}, finest first), or none for the last block's map", argument="feature_blocks")
        self.features = PyramidFeatures(backbone, pyramid_dim=pyramid_dim, feature_blocks=feature_blocks)
        self.head = SemanticFPNHead(pyramid_dim, head_dim, num_classes)
        self.num_classes = num_classes
        self.config = dict(config or {})

    @property
    def backbone(self) -> VisionTransformerBase:
        return self.features.backbone

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` -> logits ``(B, num_classes, H, W)``."""
        return self.head(self.features(x), size=tuple(x.shape[-2:]))

    # what evaluation and resolution transfer ask of a model: the backbone's
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _FROM_BACKBONE:
                return getattr(self.features.backbone, name)
            raise

    def set_patch_size(self, patch_size: int, rescale_field: bool = False) -> None:
        """The backbone's ``set_patch_size``; the pyramid's strides follow the patch."""
        self.backbone.set_patch_size(patch_size, rescale_field=rescale_field)
        self.config["patch_size"] = patch_size

    def rescale_field(self, factor_y: float, factor_x: float) -> None:
        """The backbone's ``rescale_field`` (every SSoG field scaled by the grid ratio)."""
        self.backbone.rescale_field(factor_y, factor_x)
        if "radius" in self.backbone.config:
            self.config["radius"] = self.backbone.config["radius"]

    def save_pretrained(self, save_directory: Any, *, overwrite: bool = False) -> None:
        """Refused in one line (`UsageError`): the hub layout (``config.json`` + ``model.safetensors``, timm's
        ``local-dir:``) describes an image classifier by its timm architecture; a segmentation model is saved with
        ``ssogvit.train.export_safetensors`` and read back with ``load_model`` (docs/dense.md)."""
        raise UsageError("save_pretrained writes timm's hub layout of an image classifier; save a segmentation model "
                         "with ssogvit.train.export_safetensors(model, path) and load it with "
                         "ssogvit.train.load_model(path)")

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """The backbone's set (under ``features.backbone.``) and every parameter of at most one dimension."""
        inner = {f"features.backbone.{n}" for n in self.backbone.no_weight_decay()}
        return inner | {n for n, p in self.named_parameters() if p.ndim <= 1}

    def forward_bytes(self, batch: int, img_size: int | tuple[int, int]) -> int:
        """A lower bound on the bytes of one inference forward: the backbone's, and the logits at full size."""
        h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
        return self.backbone.forward_bytes(batch, img_size) + batch * self.num_classes * h * w * 4


_FROM_BACKBONE = ("patch_size", "grid_size", "img_size", "in_chans", "embed_dim", "mixers", "mixer_name", "family",
                  "depth", "num_prefix_tokens", "blocks")
