"""The three model families of SPEC section 6 (discrete ViT, looped ViT, continuous ODE-ViT), built by name."""

from ._common import GLOBAL_POOLS, SIZES, Block, CenterNorm, VisionTransformerBase
from .looped import LoopedViT
from .ode import ADAPTIVE_SOLVERS, FIXED_GRID_SOLVERS, ODEViT
from .registry import FAMILIES, create_model, list_models, model_options, parse_model_name, timm_name
from .transfer import rescale_field, resize_patch_embed, resize_pos_embed
from .vit import VisionTransformer

__all__ = [
    "ADAPTIVE_SOLVERS",
    "FAMILIES",
    "FIXED_GRID_SOLVERS",
    "GLOBAL_POOLS",
    "SIZES",
    "Block",
    "CenterNorm",
    "LoopedViT",
    "ODEViT",
    "VisionTransformer",
    "VisionTransformerBase",
    "create_model",
    "list_models",
    "model_options",
    "parse_model_name",
    "rescale_field",
    "resize_patch_embed",
    "resize_pos_embed",
    "timm_name",
]
