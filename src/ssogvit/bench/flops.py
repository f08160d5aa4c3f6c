"""Forward FLOPs per image, counted analytically from a model's structure (docs/benchmarks.md, paper Table 4).

Convention (2 FLOPs per multiply-add; the one that reproduces the paper's Table 4 to within 0.5% at 224..768, see
``docs/benchmarks.md``). With ``T = P + N`` tokens (``P`` prefix tokens: class, registers; ``N = Gh * Gw`` patches),
width ``D``, ``H`` heads, ``R`` atoms, the multiply-adds are:

- patch embedding: ``N * D * C * p^2`` (a conv with stride = kernel = ``p``);
- every linear layer inside a block (QKV, output projection, MLP) acts on all ``T`` tokens, except SSoG's value
  projection, which needs the ``N`` patch tokens only (prefix outputs are means of patch values, docs/operator.md);
- attention core: ``T^2 * D`` for the scores and ``T^2 * D`` for ``A V`` (the class token attends and is attended);
- SSoG core: ``R * D * N * (Gh + Gw)`` (per atom, one pass down the columns and one across the rows, over the
  patch grid only) plus ``P * N * D`` for the prefix aggregates (the mean of the patch values);
- steered SSoG adds its three steering maps, ``N * D * 5 H R`` (they read the patch tokens only);
- head: one vector per image.

Normalisation, activations, softmax and exponentials, kernel-table construction and residual additions are not
counted (nor does the paper, nor ``FlopCounterMode``). A block's cost is counted once per application: a looped or
continuous-depth model with one block counts it ``model.depth`` times.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from timm.layers import to_2tuple
from torch import nn

from ssogvit.layers import SSoGAttention

__all__ = [
    "count_flops",
    "flops_breakdown",
    "mixer_flops",
    "measure_flops",
    "find_mixers",
    "grid_of",
    "flops_rows",
    "format_flops_table",
]


def _is_ssog(m: nn.Module) -> bool:
    return isinstance(m, SSoGAttention)


def _is_attention(m: nn.Module) -> bool:
    return isinstance(m, nn.MultiheadAttention) or (
        isinstance(getattr(m, "qkv", None), nn.Linear) and isinstance(getattr(m, "proj", None), nn.Linear)
    )


def _is_mixer(m: nn.Module) -> bool:
    return _is_ssog(m) or _is_attention(m)


def find_mixers(module: nn.Module) -> list[nn.Module]:
    """Token mixers inside ``module`` (outermost only): SSoG, attention (``qkv`` and ``proj``), MultiheadAttention."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if _is_mixer(m):
            found.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return found


def _linear_macs(lin: nn.Linear, rows: int) -> int:
    return rows * lin.in_features * lin.out_features


def mixer_flops(mixer: nn.Module, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, int]:
    """FLOPs of one call of one mixer on one image, split into ``projections``, ``core``, ``steering``, ``total``.

    Args:
        mixer: an SSoG mixer (``ssogvit.layers.SSoGAttention``), an attention mixer (``qkv`` and ``proj``) or
            ``nn.MultiheadAttention`` (self-attention).
        grid: the patch grid ``(Gh, Gw)``.
        num_prefix_tokens: class and register tokens in front of the patches.
    """
    gh, gw = to_2tuple(grid)
    n = gh * gw
    t = n + num_prefix_tokens
    proj = core = steer = 0
    if _is_ssog(mixer):
        atoms = int(mixer.mu.shape[1])
        dim = mixer.v.out_features
        # prefix outputs are the mean of the patch values (docs/operator.md): values are needed for patches only
        proj = _linear_macs(mixer.v, n) + _linear_macs(mixer.proj, t)
        core = atoms * dim * n * (gh + gw) + num_prefix_tokens * n * dim
        for name in ("mu_steer", "sigma_steer", "lambda_steer"):
            lin = getattr(mixer, name, None)
            if isinstance(lin, nn.Linear):
                steer += _linear_macs(lin, n)
    elif isinstance(mixer, nn.MultiheadAttention):
        dim = mixer.embed_dim
        proj = 4 * t * dim * dim
        core = 2 * t * t * dim
    elif _is_attention(mixer):
        dim = mixer.qkv.in_features
        proj = _linear_macs(mixer.qkv, t) + _linear_macs(mixer.proj, t)
        core = 2 * t * t * dim
    else:
        raise TypeError(f"not a recognised token mixer: {type(mixer).__name__}")
    out = {"projections": 2 * proj, "core": 2 * core, "steering": 2 * steer}
    out["total"] = sum(out.values())
    return out


def _patch_conv(model: nn.Module) -> nn.Conv2d:
    pe = getattr(model, "patch_embed", None)
    if pe is None:
        raise TypeError(f"{type(model).__name__} has no patch_embed")
    if isinstance(pe, nn.Conv2d):
        return pe
    for m in pe.modules():
        if isinstance(m, nn.Conv2d):
            return m
    raise TypeError("patch_embed holds no Conv2d")


def grid_of(model: nn.Module, img_size: int | tuple[int, int]) -> tuple[int, int]:
    """The patch grid ``(Gh, Gw)`` a model sees at ``img_size``."""
    conv = _patch_conv(model)
    h, w = to_2tuple(img_size)
    sh, sw = conv.stride
    return h // sh, w // sw


def flops_breakdown(model: nn.Module, img_size: int | tuple[int, int]) -> dict[str, int]:
    """Forward FLOPs per image of a ViT-like model, by part.

    Works for the project's three families and for timm ``VisionTransformer`` s: it reads ``patch_embed``,
    ``blocks``, ``head``, ``num_prefix_tokens`` and (if present) ``depth``, the number of block applications per
    forward (a looped or continuous-depth model applies its one block ``depth`` times).

    Returns:
        A dict of FLOP counts: ``patch_embed``, ``mixer`` (attention alone, all applications), with its parts
        ``mixer_projections``, ``mixer_core``, ``mixer_steering``; ``mlp`` (every other linear layer in the blocks),
        ``head`` and ``total``.
    """
    gh, gw = grid_of(model, img_size)
    n = gh * gw
    prefix = int(getattr(model, "num_prefix_tokens", 1))
    t = n + prefix
    conv = _patch_conv(model)
    kh, kw = conv.kernel_size
    patch = n * conv.out_channels * (conv.in_channels // conv.groups) * kh * kw

    blocks = list(getattr(model, "blocks", []))
    depth = getattr(model, "depth", None)
    reps = 1
    if isinstance(depth, int) and blocks:
        if depth % len(blocks):
            raise ValueError(f"model.depth={depth} is not a multiple of its {len(blocks)} blocks")
        reps = depth // len(blocks)

    parts = {"mixer_projections": 0, "mixer_core": 0, "mixer_steering": 0, "mlp": 0}
    for block in blocks:
        mixers = find_mixers(block)
        inside = {id(p) for m in mixers for p in m.modules()}
        for m in mixers:
            f = mixer_flops(m, (gh, gw), prefix)
            parts["mixer_projections"] += reps * f["projections"]
            parts["mixer_core"] += reps * f["core"]
            parts["mixer_steering"] += reps * f["steering"]
        for m in block.modules():
            if isinstance(m, nn.Linear) and id(m) not in inside:
                parts["mlp"] += reps * 2 * _linear_macs(m, t)
            elif isinstance(m, nn.Conv2d | nn.Conv1d) and id(m) not in inside:
                warnings.warn(f"convolution {type(m).__name__} inside a block is not counted", stacklevel=2)

    head = 0
    head_mod = getattr(model, "head", None)
    if isinstance(head_mod, nn.Linear):
        head = 2 * head_mod.in_features * head_mod.out_features
    out = {"patch_embed": 2 * patch, **parts}
    out["mixer"] = parts["mixer_projections"] + parts["mixer_core"] + parts["mixer_steering"]
    out["head"] = head
    out["total"] = out["patch_embed"] + out["mixer"] + out["mlp"] + head
    return out


def count_flops(model: nn.Module, img_size: int | tuple[int, int]) -> int:
    """Analytic forward FLOPs of one image through ``model`` at ``img_size`` (2 per multiply-add).

    See ``flops_breakdown`` for the parts (``flops_breakdown(model, s)["mixer"]`` is attention alone).
    """
    return flops_breakdown(model, img_size)["total"]


# --- measured count, to cross-check the analytic one ------------------------------------------------------------

def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _native_mha_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # self/cross attention through nn.MultiheadAttention's fast path: q, k, v, output projections and the core
    b, lq, e = query_shape
    lk = key_shape[1]
    return 2 * (b * lq * e * e + 2 * b * lk * e * e + 2 * b * lq * lk * e + b * lq * e * e)


def _custom_mapping() -> dict:
    aten = torch.ops.aten
    mapping = {}
    # CPU SDPA and nn.MultiheadAttention's fast path are not in torch's FLOP registry (they count as 0).
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flop
    if hasattr(aten, "_native_multi_head_attention"):
        mapping[aten._native_multi_head_attention] = _native_mha_flop
    return mapping


def measure_flops(model: nn.Module, img_size: int | tuple[int, int], *, in_chans: int | None = None) -> int:
    """Forward FLOPs per image counted by ``torch.utils.flop_counter.FlopCounterMode`` (one image, no grad).

    CPU scaled-dot-product attention and ``nn.MultiheadAttention``'s fast path are absent from torch's FLOP
    registry; they are added here with torch's own SDPA formula. SSoG mixes through the torch path here: the C
    kernel of ``ssogvit.backends.cpu`` does the same multiply-adds where the counter cannot see them.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from ..backends import cpu

    h, w = to_2tuple(img_size)
    conv = _patch_conv(model)
    chans = in_chans or conv.in_channels
    param = next(model.parameters())
    x = torch.randn(1, chans, h, w, device=param.device, dtype=param.dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), cpu.enabled(False), FlopCounterMode(display=False,
                                                                 custom_mapping=_custom_mapping()) as counter:
            model(x)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


def flops_rows(
    names: list[str],
    resolutions: list[int],
    *,
    check: bool = False,
    model_kwargs: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Analytic (and with ``check``, FlopCounterMode) GFLOPs per image for each model name and resolution, with the
    paper's Table 4 value where it has one (base width, 12 block applications). ``log`` gets one line per point
    as it is done (``[3/30] vit-base-ssog res=512: ...``)."""
    from ssogvit.bench._paper import table4
    from ssogvit.models import create_model

    rows = []
    for name in names:
        model = None
        for res in resolutions:
            if model is None or check:
                model = create_model(name, img_size=res, **(model_kwargs or {})).eval()
            parts = flops_breakdown(model, res)
            mixer = getattr(model, "mixer_name", name.split("-", 2)[-1])
            row = {
                "model": name, "res": res, "tokens": int(getattr(model, "num_prefix_tokens", 1))
                + grid_of(model, res)[0] * grid_of(model, res)[1],
                "gflops": parts["total"] / 1e9, "attention_gflops": parts["mixer"] / 1e9,
                "mlp_gflops": parts["mlp"] / 1e9, "patch_embed_gflops": parts["patch_embed"] / 1e9,
            }
            base_width = getattr(model, "embed_dim", None) == 768 and getattr(model, "depth", None) == 12
            if base_width:
                row["paper_gflops"] = table4(mixer, res)
                row["paper_attention_gflops"] = table4(mixer, res, attention=True)
            if check:
                row["measured_gflops"] = measure_flops(model, res) / 1e9
            rows.append(row)
            if log is not None:
                counted = f", counted {row['measured_gflops']:.2f}" if check else ""
                log(f"[{len(rows)}/{len(names) * len(resolutions)}] {name} res={res}: analytic "
                    f"{row['gflops']:.2f}{counted} GFLOPs")
    return rows


def format_flops_table(rows: list[dict]) -> str:
    """A Markdown table of ``flops_rows``: analytic, measured and the paper's GFLOPs, with relative differences."""

    def f(v, fmt=".2f"):
        return format(v, fmt) if isinstance(v, int | float) else "-"

    def rel(a, b):
        return f"{100 * (a / b - 1):+.2f}%" if isinstance(a, int | float) and isinstance(b, int | float) else "-"

    lines = [
        "| model | res | tokens | GFLOPs | attention GFLOPs | FlopCounterMode | diff | paper | diff "
        "| paper attention | diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['res']} | {r['tokens']} | {f(r['gflops'])} | {f(r['attention_gflops'])} "
            f"| {f(r.get('measured_gflops'))} | {rel(r.get('measured_gflops'), r['gflops'])} "
            f"| {f(r.get('paper_gflops'), '.1f')} | {rel(r['gflops'], r.get('paper_gflops'))} "
            f"| {f(r.get('paper_attention_gflops'), '.1f')} "
            f"| {rel(r['attention_gflops'], r.get('paper_attention_gflops'))} |"
        )
    return "\n".join(lines)
