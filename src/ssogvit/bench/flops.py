"""Forward FLOPs per image, counted analytically from a model's modules by the convention of docs/benchmarks.md
("FLOPs: the convention, and the paper's Table 4"), and checked with torch's ``FlopCounterMode``."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from timm.layers import Attention as TimmAttention
from timm.layers import to_2tuple
from torch import nn

from ssogvit.layers import Attention, is_ssog
from ssogvit.results import markdown_table

__all__ = ["TABLE4_ATTENTION", "TABLE4_TOTAL", "count_flops", "find_mixers", "flops_breakdown", "flops_rows",
           "format_flops_table", "grid_of", "measure_flops", "mixer_flops"]

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
    """FLOPs of one call of one mixer on one image: ``projections``, ``core``, ``steering`` and ``total``; a mixer with
    a method ``flops(grid, num_prefix_tokens)`` is taken at its word (window, neighbourhood, linear attention), one that
    is neither SSoG, nor dense attention, nor counts its own is a ``TypeError`` (never a guess)."""
    gh, gw = to_2tuple(grid)
    n, steer = gh * gw, 0
    t = n + num_prefix_tokens
    if callable(getattr(mixer, "flops", None)):
        return mixer.flops((gh, gw), num_prefix_tokens)
    if is_ssog(mixer):
        d = mixer.v.out_features
        proj = n * d * d + t * d * d  # values of the patches only, output projection of every token
        core = int(mixer.mu.shape[1]) * d * n * (gh + gw) + num_prefix_tokens * n * d
        maps = [getattr(mixer, f"{p}_steer", None) for p in ("mu", "sigma", "lambda")]
        steer = sum(n * m.in_features * m.out_features for m in maps if isinstance(m, nn.Linear))
    elif isinstance(mixer, _ATTENTION):
        d = mixer.embed_dim if isinstance(mixer, nn.MultiheadAttention) else mixer.qkv.in_features
        proj, core = 4 * t * d * d, 2 * t * t * d
    else:
        raise TypeError(f"cannot count the FLOPs of {type(mixer).__name__}: not SSoG or dense attention, and it has "
                        "no flops(grid, num_prefix_tokens)")
    out = {"projections": 2 * proj, "core": 2 * core, "steering": 2 * steer}
    return out | {"total": sum(out.values())}


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
    ``total``. ``model.depth``, where present, is the number of block applications (looped and ODE models)."""
    (gh, gw), prefix, conv = grid_of(model, img_size), int(getattr(model, "num_prefix_tokens", 1)), _patch_conv(model)
    t = gh * gw + prefix
    blocks, depth = list(getattr(model, "blocks", [])), getattr(model, "depth", None)
    if isinstance(depth, int) and blocks and depth % len(blocks):
        raise ValueError(f"model.depth={depth} is not a multiple of its {len(blocks)} blocks")
    reps = depth // len(blocks) if isinstance(depth, int) and blocks else 1
    parts = dict.fromkeys(("mixer_projections", "mixer_core", "mixer_steering", "mlp"), 0)
    for block in blocks:
        mixers = find_mixers(block)
        for m in mixers:
            f = mixer_flops(m, (gh, gw), prefix)
            for part in ("projections", "core", "steering"):
                parts[f"mixer_{part}"] += reps * f[part]
        inside = {id(p) for m in mixers for p in m.modules()}
        for m in block.modules():
            if isinstance(m, nn.Linear) and id(m) not in inside:
                parts["mlp"] += reps * 2 * t * m.in_features * m.out_features
            elif isinstance(m, nn.Conv1d | nn.Conv2d) and id(m) not in inside:
                warnings.warn(f"convolution {type(m).__name__} inside a block is not counted", stacklevel=2)
    head = getattr(model, "head", None)
    out = {"patch_embed": 2 * gh * gw * conv.out_channels * (conv.in_channels // conv.groups) * conv.kernel_size[0]
           * conv.kernel_size[1], **parts,
           "mixer": parts["mixer_projections"] + parts["mixer_core"] + parts["mixer_steering"],
           "head": 2 * head.in_features * head.out_features if isinstance(head, nn.Linear) else 0}
    return out | {"total": out["patch_embed"] + out["mixer"] + out["mlp"] + out["head"]}


def count_flops(model: nn.Module, img_size: int | tuple[int, int]) -> int:
    """Analytic forward FLOPs of one image at ``img_size`` (``flops_breakdown(model, s)["mixer"]``: attention alone)."""
    return flops_breakdown(model, img_size)["total"]


def _custom_mapping() -> dict:
    """CPU SDPA and ``nn.MultiheadAttention``'s fast path, absent from torch's FLOP registry (they count 0 there)."""
    from torch.utils.flop_counter import sdpa_flop_count

    def sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def native_mha(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        (b, lq, e), lk = query_shape, key_shape[1]  # projections and core
        return 2 * (2 * b * lq * e * e + 2 * b * lk * e * e + 2 * b * lq * lk * e)

    pairs = [("_scaled_dot_product_flash_attention_for_cpu", sdpa), ("_native_multi_head_attention", native_mha)]
    return {getattr(torch.ops.aten, name): fn for name, fn in pairs if hasattr(torch.ops.aten, name)}


def measure_flops(model: nn.Module, img_size: int | tuple[int, int], *, in_chans: int | None = None) -> int:
    """Forward FLOPs of one image counted by ``FlopCounterMode`` (no grad), SSoG through the torch path (the C kernel
    of ``ssogvit.backends.cpu`` does the same multiply-adds where the counter cannot see them)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..backends import cpu

    param, was_training = next(model.parameters()), model.training
    x = torch.randn(1, in_chans or _patch_conv(model).in_channels, *to_2tuple(img_size), device=param.device,
                    dtype=param.dtype)
    counter = FlopCounterMode(display=False, custom_mapping=_custom_mapping())
    try:
        with torch.no_grad(), cpu.enabled(False), counter:
            model.eval()(x)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


def flops_rows(names: list[str], resolutions: list[int], *, check: bool = False, model_kwargs: dict | None = None,
               log: Callable[[str], None] | None = None) -> list[dict]:
    """Analytic (with ``check``, also ``FlopCounterMode``) GFLOPs per image for each model name and resolution, with
    the paper's Table 4 value at base width and 12 applications; ``log`` gets one line per point."""
    from ssogvit.models import create_model

    rows = []
    for name in names:
        model = None
        for res in resolutions:
            if model is None or check:  # the check runs a forward at each resolution's own position embedding
                model = create_model(name, img_size=res, **(model_kwargs or {})).eval()
            parts = flops_breakdown(model, res)
            gh, gw = grid_of(model, res)
            row = {"model": name, "res": res, "tokens": model.num_prefix_tokens + gh * gw,
                   "gflops": parts["total"] / 1e9, "attention_gflops": parts["mixer"] / 1e9,
                   "mlp_gflops": parts["mlp"] / 1e9, "patch_embed_gflops": parts["patch_embed"] / 1e9}
            paper = "mha" if model.mixer_name.startswith("mha") else model.mixer_name
            if (model.embed_dim, model.depth) == (768, 12):
                row["paper_gflops"] = TABLE4_TOTAL.get(paper, {}).get(res)
                row["paper_attention_gflops"] = TABLE4_ATTENTION.get(paper, {}).get(res)
            if check:
                row["measured_gflops"] = measure_flops(model, res) / 1e9
            rows.append(row)
            if log is not None:
                counted = f", counted {row['measured_gflops']:.2f}" if check else ""
                log(f"[{len(rows)}/{len(names) * len(resolutions)}] {name} res={res}: analytic "
                    f"{row['gflops']:.2f}{counted} GFLOPs")
    return rows


def format_flops_table(rows: list[dict]) -> str:
    """Markdown of ``flops_rows``: analytic, counted and the paper's GFLOPs, with relative differences."""
    from ssogvit.bench.sweeps import cell

    def rel(a, b):
        return f"{100 * (a / b - 1):+.2f}%" if isinstance(a, int | float) and isinstance(b, int | float) else "-"

    lines = [[r["model"], r["res"], r["tokens"], cell(r["gflops"]), cell(r["attention_gflops"]),
              cell(r.get("measured_gflops")), rel(r.get("measured_gflops"), r["gflops"]),
              cell(r.get("paper_gflops"), ".1f"), rel(r["gflops"], r.get("paper_gflops")),
              cell(r.get("paper_attention_gflops"), ".1f"), rel(r["attention_gflops"], r.get("paper_attention_gflops"))]
             for r in rows]
    return markdown_table(["model", "res", "tokens", "GFLOPs", "attention GFLOPs", "FlopCounterMode", "diff", "paper",
                           "diff", "paper attention", "diff"], lines).rstrip("\n")
