"""Forward FLOPs per image, counted analytically from a model's modules by the convention of docs/benchmarks.md
("FLOPs: the convention, and the paper's Table 4"), and checked with torch's ``FlopCounterMode``."""

from __future__ import annotations

import warnings

import torch
from timm.layers import Attention as TimmAttention
from timm.layers import to_2tuple
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ssogvit.backends import cpu
from ssogvit.layers import Attention, is_ssog

__all__ = ["TABLE4_ATTENTION", "TABLE4_TOTAL", "count_flops", "find_mixers", "flops_breakdown", "grid_of",
           "measure_flops", "mixer_flops"]

#: the paper's Table 4: forward GFLOPs per image at D = 768, 12 block applications, whole model and attention alone
TABLE4_TOTAL = {"mha": {224: 35.1, 384: 111.0, 512: 214.1, 640: 368.3, 768: 590.1},
                "ssog": {224: 28.4, 384: 84.3, 512: 151.1, 640: 237.9, 768: 345.3}}
TABLE4_ATTENTION = {"mha": {224: 12.6, 768: 326.4}, "ssog": {224: 6.0, 768: 81.7}}
#: dense attention mixers whose forward is known: qkv (or in-projection) -> softmax attention -> output projection
_ATTENTION = (Attention, TimmAttention, nn.MultiheadAttention)


def find_mixers(module: nn.Module) -> list[nn.Module]:
    """Token mixers inside ``module`` (outermost only): SSoG, dense attention, or a mixer that counts its own
    ``flops(grid, num_prefix_tokens)``; recognised by class, never by parameter names."""
    if callable(getattr(module, "flops", None)) or is_ssog(module) or isinstance(module, _ATTENTION):
        return [module]
    return [m for child in module.children() for m in find_mixers(child)]


def mixer_flops(mixer: nn.Module, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, int]:
    """FLOPs of one call of one mixer on one image: ``projections``, ``core``, ``steering`` and ``total`` by the
    definition, and ``core_read``, the core's FLOPs over the kernel entries the C kernel reads (SSoG's bands where they
    pay, at its fixed field's widths, which a steered field starts from: ``SSoGAttention.read_entries``; the
    definition's elsewhere); a mixer with a method ``flops(grid, num_prefix_tokens)`` is taken at its word (window,
    neighbourhood, linear attention), one that is neither SSoG, nor dense attention, nor counts its own is a
    ``TypeError`` (never a guess)."""
    gh, gw = to_2tuple(grid)
    n, steer = gh * gw, 0
    t = n + num_prefix_tokens
    if callable(getattr(mixer, "flops", None)):
        own = mixer.flops((gh, gw), num_prefix_tokens)
        return own | {"core_read": own.get("core_read", own["core"])}
    if is_ssog(mixer):
        d = mixer.v.out_features
        proj = n * d * d + t * d * d  # values of the patches only, output projection of every token
        core = int(mixer.mu.shape[1]) * d * n * (gh + gw) + num_prefix_tokens * n * d
        # the entries the C kernel reads: each x-row's of every query row, each y-row's of every query column
        ry, rx = mixer.read_entries((gh, gw))
        read = d // mixer.num_heads * (gw * ry + gh * rx) + num_prefix_tokens * n * d
        maps = [getattr(mixer, f"{p}_steer", None) for p in ("mu", "sigma", "lambda")]
        # the maps run on every token (prefix rows included: their outputs are not copied out of the patch rows)
        steer = sum(t * m.in_features * m.out_features for m in maps if isinstance(m, nn.Linear))
    elif isinstance(mixer, _ATTENTION):
        d = mixer.embed_dim if isinstance(mixer, nn.MultiheadAttention) else mixer.qkv.in_features
        proj, core = 4 * t * d * d, 2 * t * t * d
        read = core
    else:
        raise TypeError(f"cannot count the FLOPs of {type(mixer).__name__}: not SSoG or dense attention, and it has "
                        "no flops(grid, num_prefix_tokens)")
    out = {"projections": 2 * proj, "core": 2 * core, "steering": 2 * steer}
    return out | {"total": sum(out.values()), "core_read": 2 * read}


def _patch_conv(model: nn.Module) -> nn.Conv2d:
    conv = next((m for m in getattr(model, "patch_embed", nn.Identity()).modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        raise TypeError(f"{type(model).__name__} has no patch_embed convolution")
    return conv


def grid_of(model: nn.Module, img_size: int | tuple[int, int]) -> tuple[int, int]:
    """The patch grid ``(Gh, Gw)`` a model sees at ``img_size``."""
    (h, w), (sh, sw) = to_2tuple(img_size), _patch_conv(model).stride
    return h // sh, w // sw


def flops_breakdown(model: nn.Module, img_size: int | tuple[int, int]) -> dict[str, int]:
    """Forward FLOPs per image of a ViT-like model, by part: ``patch_embed``, ``mixer`` (all applications) with
    ``mixer_projections``, ``mixer_core``, ``mixer_steering``; ``mlp`` (the blocks' other linear layers), ``head``,
    ``total``; and ``mixer_core_read``, ``total_read``: the same over the kernel entries the C kernel reads
    (``mixer_flops``' ``core_read``). ``model.depth``, where present, is the number of block applications (looped and ODE models)."""
    (gh, gw), prefix, conv = grid_of(model, img_size), int(getattr(model, "num_prefix_tokens", 1)), _patch_conv(model)
    t = gh * gw + prefix
    blocks, depth = list(getattr(model, "blocks", [])), getattr(model, "depth", None)
    if isinstance(depth, int) and blocks and depth % len(blocks):
        raise ValueError(f"model.depth={depth} is not a multiple of its {len(blocks)} blocks")
    reps = depth // len(blocks) if isinstance(depth, int) and blocks else 1
    parts = dict.fromkeys(("mixer_projections", "mixer_core", "mixer_steering", "mixer_core_read", "mlp"), 0)
    for block in blocks:
        mixers = find_mixers(block)
        for f in (mixer_flops(m, (gh, gw), prefix) for m in mixers):
            for part in ("projections", "core", "steering", "core_read"):
                parts[f"mixer_{part}"] += reps * f[part]
        inside = {id(p) for m in mixers for p in m.modules()}
        for m in (m for m in block.modules() if id(m) not in inside):
            if isinstance(m, nn.Linear):
                parts["mlp"] += reps * 2 * t * m.in_features * m.out_features
            elif isinstance(m, nn.Conv1d | nn.Conv2d):
                warnings.warn(f"convolution {type(m).__name__} inside a block is not counted", stacklevel=2)
    head = getattr(model, "head", None)
    out = {"patch_embed": 2 * gh * gw * conv.out_channels * (conv.in_channels // conv.groups) * conv.kernel_size[0]
           * conv.kernel_size[1], **parts,
           "mixer": parts["mixer_projections"] + parts["mixer_core"] + parts["mixer_steering"],
           "head": 2 * head.in_features * head.out_features if isinstance(head, nn.Linear) else 0}
    total = out["patch_embed"] + out["mixer"] + out["mlp"] + out["head"]
    return out | {"total": total, "total_read": total - out["mixer_core"] + out["mixer_core_read"]}


def count_flops(model: nn.Module, img_size: int | tuple[int, int]) -> int:
    """Analytic forward FLOPs of one image at ``img_size`` (``flops_breakdown(model, s)["mixer"]``: attention alone)."""
    return flops_breakdown(model, img_size)["total"]


def _custom_mapping() -> dict:
    """CPU SDPA and ``nn.MultiheadAttention``'s fast path, absent from torch's FLOP registry (they count 0 there)."""

    def sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def native_mha(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        (b, lq, e), lk = query_shape, key_shape[1]  # projections and core
        return 2 * (2 * b * lq * e * e + 2 * b * lk * e * e + 2 * b * lq * lk * e)

    pairs = [("_scaled_dot_product_flash_attention_for_cpu", sdpa), ("_native_multi_head_attention", native_mha)]
    return {getattr(torch.ops.aten, name): fn for name, fn in pairs if hasattr(torch.ops.aten, name)}


def measure_flops(model: nn.Module, img_size: int | tuple[int, int]) -> int:
    """Forward FLOPs of one image counted by ``FlopCounterMode`` (no grad), SSoG through the torch path (the C kernel
    of ``ssogvit.backends.cpu`` does the same multiply-adds where the counter cannot see them)."""
    param, was_training = next(model.parameters()), model.training
    x = torch.randn(1, _patch_conv(model).in_channels, *to_2tuple(img_size), device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False, custom_mapping=_custom_mapping())
    try:
        with torch.no_grad(), cpu.enabled(False), counter:
            model.eval()(x)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())
