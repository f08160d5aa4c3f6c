"""Your own weights into any registered model (docs/models.md, "Your own weights"; docs/dense.md).

No weights can be downloaded for ssogvit's models, so fine-tuning starts from weights the user has: an ssogvit export
or ``save_pretrained`` file (a classifier or a segmentation model; a Lightning checkpoint's weights are its run's
``export/model.safetensors``), or a timm ViT's state dict. ``carry_state_dict`` renames any of them onto the model at
hand, a classifier or a ``PyramidViT``; it is the ``pretrained_filter_fn`` of every registered name, so timm's own way
of loading local weights works::

    timm.create_model("ssogvit_vit_tiny_ssog_pyramid", pretrained=True,
                      pretrained_cfg_overlay=dict(file="own/model.safetensors"))

and ``ssogvit.models.load_weights`` does the same for a model already built (an smp network, timm's features
wrapper)::

    ssogvit.models.load_weights(net, "own/model.safetensors")

What is carried: every backbone weight, strictly (a missing or unexpected one is an error); a segmentation model's
pyramid too. What starts from the model's own initialisation: the parts the source lacks (the pyramid and its head
under a classifier's weights; the classifier when the class count differs), and, from an attention checkpoint into
an SSoG model, each block's field: the value rows of ``qkv`` and the output projection are carried, as ``ssogify``
carries them (docs/operator.md), queries, keys and their norms dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor, nn

__all__ = ["carry_state_dict", "target_model"]


def _strip(state: Mapping[str, Tensor], lead: str) -> dict[str, Tensor]:
    return {k[len(lead):]: v for k, v in state.items() if k.startswith(lead)}


def target_model(module: nn.Module) -> nn.Module:
    """The ssogvit model inside ``module``: a ``PyramidViT`` (itself, or inside an smp network or timm's features
    wrapper), else a classifier (``VisionTransformerBase``); ``ValueError`` if there is none."""
    from ._common import VisionTransformerBase
    from .dense import PyramidViT

    for kind in (PyramidViT, VisionTransformerBase):
        found = next((m for m in module.modules() if isinstance(m, kind)), None)
        if found is not None:
            return found
    raise ValueError(f"{type(module).__name__} holds no ssogvit model to load weights into")


def carry_state_dict(state: Mapping[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state`` renamed onto ``model`` (a classifier of ours or a ``PyramidViT``), ready for a strict load.

    Accepted sources: a classifier's keys (ours or a timm ViT's), a ``PyramidViT``'s or timm ``FeatureGetterNet``'s
    (``model.`` in front), a segmentation model's (``features.`` in front; its head is dropped), a Lightning
    checkpoint's (``model.`` in front). The source head is dropped where the model has none or one of another shape.
    """
    from .dense import PyramidViT

    own = model.state_dict()
    state = dict(state)
    if any(k.startswith("model.") for k in state):  # Lightning's module, timm's features wrapper
        state = _strip(state, "model.")
    if state and all(k.startswith("module.") for k in state):  # DistributedDataParallel
        state = _strip(state, "module.")
    if any(k.startswith("features.backbone.") for k in state):  # a segmentation model: its backbone and pyramid
        state = _strip(state, "features.")
    if not any(k.startswith("backbone.") for k in state):  # a classifier's: its backbone in the pyramid's layout
        state = {f"backbone.{k}": v for k, v in state.items()}
    if not isinstance(model, PyramidViT):  # a classifier: the backbone (with its head) is the model
        state = _strip(state, "backbone.")
    fill = [k for k in own if k.startswith(("pyramid.", "head."))] if isinstance(model, PyramidViT) else []
    for key in [k for k in state if k.startswith(("head.", "backbone.head."))]:
        if key not in own or own[key].shape != state[key].shape:  # a head of another task or class count
            del state[key]
    fill += [k for k in own if k.startswith("head.")]
    pos = "backbone.pos_embed" if isinstance(model, PyramidViT) else "pos_embed"
    if pos in state and pos in own and state[pos].shape != own[pos].shape:
        state[pos] = _resized_pos_embed(state[pos], own[pos], target_model(model))
    for key in own:  # an attention block into an SSoG one: what ssogify carries
        if key.endswith(".attn.v.weight") and key not in state:
            attn = key[: -len("v.weight")]
            if f"{attn}qkv.weight" not in state:
                continue
            d = own[key].shape[0]
            for part in ("weight", "bias"):
                qkv = state.pop(f"{attn}qkv.{part}", None)
                if qkv is not None:
                    state[f"{attn}v.{part}"] = qkv[2 * d:]
            for dropped in [k for k in state if k.startswith((f"{attn}q_norm.", f"{attn}k_norm."))]:
                del state[dropped]
            fill += [k for k in own if k.startswith(attn)]
    for key in fill:
        state.setdefault(key, own[key])
    return state


def _resized_pos_embed(pos: Tensor, own: Tensor, model: nn.Module) -> Tensor:
    """A square grid's position embedding (class token first) resized bicubically to the model's grid, as timm does
    for a ViT at another image size; any other mismatch is left for the strict load to name."""
    from .transfer import resize_pos_embed

    side = math.isqrt(pos.shape[1] - 1)
    if side * side != pos.shape[1] - 1 or pos.shape[2] != own.shape[2]:
        return pos
    backbone = getattr(model, "backbone", model)
    return resize_pos_embed(pos, (side, side), tuple(backbone.grid_size), num_prefix_tokens=1)
