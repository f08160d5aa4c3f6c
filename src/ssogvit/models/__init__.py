"""The three model families of docs/models.md (discrete ViT, looped ViT, continuous ODE-ViT), built by name."""

from ._common import GLOBAL_POOLS, SIZES, Block, BlockStack, CenterNorm, VisionTransformerBase
from .looped import Loop, LoopedViT
from .dense import PyramidFeatures, PyramidViT, SegmentationModel, SemanticFPNHead, SimpleFeaturePyramid
from .pretrained import carry_state_dict
from .maps import record_attention
from .ode import ADAPTIVE_SOLVERS, FIXED_GRID_SOLVERS, STEPPED_SOLVERS, Flow, ODEViT
from .registry import (
    FAMILIES,
    check_model_config,
    create_model,
    create_segmentation_model,
    from_pretrained,
    list_models,
    load_weights,
    model_options,
    parse_model_name,
    timm_name,
)
from .transfer import resize_patch_embed, resize_pos_embed
from .vit import VisionTransformer

__all__ = [
    "ADAPTIVE_SOLVERS",
    "FAMILIES",
    "FIXED_GRID_SOLVERS",
    "GLOBAL_POOLS",
    "SIZES",
    "STEPPED_SOLVERS",
    "Block",
    "BlockStack",
    "CenterNorm",
    "Flow",
    "Loop",
    "PyramidFeatures",
    "PyramidViT",
    "SegmentationModel",
    "SemanticFPNHead",
    "SimpleFeaturePyramid",
    "LoopedViT",
    "ODEViT",
    "VisionTransformer",
    "VisionTransformerBase",
    "carry_state_dict",
    "check_model_config",
    "create_model",
    "create_segmentation_model",
    "from_pretrained",
    "list_models",
    "load_weights",
    "model_options",
    "parse_model_name",
    "record_attention",
    "resize_patch_embed",
    "resize_pos_embed",
    "timm_name",
]
