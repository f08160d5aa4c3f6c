"""Teacher in, student out: load an attention ViT, build its SSoG twin with every weight carried over, and watch both.

The student is built by ``ssogify`` (the one definition of what carries over from an attention layer: the value rows
of ``qkv``, the output projection, their biases; see docs/operator.md), applied to a copy of the teacher. A teacher of
ours gives a student of ours (``create_model`` name ``{family}-{size}-{mixer}``, exported and reloaded like any
trained model); a timm ViT gives the ssogified timm model, rebuilt by ``load_converted``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssogvit.layers import SSoGAttention
from ssogvit.timm_compat import ssogify, unique_blocks

__all__ = [
    "ARCHITECTURE_KEYS",
    "attention_probs",
    "build_student",
    "check_teacher",
    "load_converted",
    "load_teacher",
    "record_block_outputs",
    "record_mixer_inputs",
    "teacher_grid",
]

#: options that would change the architecture; conversion keeps the teacher's
ARCHITECTURE_KEYS = ("embed_dim", "num_heads", "depth", "img_size", "patch_size", "in_chans", "num_classes",
                     "num_registers", "global_pool", "mlp_ratio")
_TIMM_KEY = "timm_model"


def _read_state(path: Path) -> dict[str, Tensor]:
    from ssogvit.documents import input_file
    from ssogvit.errors import InputError
    from ssogvit.train.io import CheckpointError

    try:
        input_file(path, "--teacher", what="file of weights")
    except InputError as err:
        raise CheckpointError(str(err)) from None
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read teacher weights {path} ({type(err).__name__}: {err})") from err
    for key in ("state_dict", "model", "state_dict_ema"):  # common wrappers of a timm / torch checkpoint
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return dict(state)


def load_teacher(path: str | Path, *, timm_model: str | None = None, timm_kwargs: Mapping[str, Any] | None = None,
                 use_ema: bool = False) -> nn.Module:
    """The teacher, in eval mode, with its weights.

    Args:
        path: a checkpoint (``.ckpt``) or export (``.safetensors``) of ours; with ``timm_model``, a local file of
            weights (``.safetensors``, or a ``.pth``/``.bin`` read with ``weights_only=True``) for that timm model.
        timm_model: timm model name (``vit_small_patch16_224``), built without downloading anything.
        timm_kwargs: keyword arguments of ``timm.create_model`` (``num_classes``, ``img_size``, ...).
        use_ema: from a checkpoint of ours trained with EMA, take the EMA weights.
    """
    path = Path(path)
    if timm_model is None:
        from ssogvit.train.io import load_model

        return load_model(path, use_ema=use_ema)
    import timm

    from ssogvit.errors import InputError
    from ssogvit.resources import check_memory

    try:
        with torch.device("meta"):  # its size first: shapes only, no memory
            n = sum(p.numel() for p in timm.create_model(timm_model, pretrained=False, **dict(timm_kwargs or {}))
                    .parameters())
        check_memory(4 * n, f"timm model {timm_model} ({n:,} parameters)", "--timm-model")
        model = timm.create_model(timm_model, pretrained=False, **dict(timm_kwargs or {}))
    except (RuntimeError, TypeError, ValueError) as err:  # timm: an unknown name, an option the model lacks
        if isinstance(err, InputError):
            raise
        raise ValueError(f"cannot build timm model {timm_model!r} with {dict(timm_kwargs or {})}: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    state = _read_state(path)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"weights in {path} do not fit timm model {timm_model!r} with {dict(timm_kwargs or {})}: "
                         f"{str(err).splitlines()[0]}") from err
    model.config_timm = {_TIMM_KEY: timm_model, "timm_kwargs": dict(timm_kwargs or {})}
    return model.eval()


def check_teacher(teacher: nn.Module) -> None:
    """Raise a ``ValueError`` unless ``teacher`` is a ViT with multi-head attention that conversion can start from."""
    if not hasattr(teacher, "patch_embed") or not hasattr(teacher, "blocks") or not hasattr(teacher, "forward_head"):
        raise ValueError(f"the teacher ({type(teacher).__name__}) is not a Vision Transformer: conversion needs "
                         "patch_embed, blocks[i].attn and forward_features/forward_head (a ViT of ours or timm's)")
    blocks = unique_blocks(teacher)
    kinds = {type(getattr(b, "attn", None)).__name__ for b in blocks}
    if any(isinstance(getattr(b, "attn", None), SSoGAttention) for b in blocks):
        raise ValueError("the teacher already mixes with SSoG; conversion starts from a multi-head-attention ViT")
    if not all(isinstance(getattr(getattr(b, "attn", None), "qkv", None), nn.Linear) for b in blocks):
        raise ValueError(f"the teacher's blocks have no multi-head attention with a fused qkv projection "
                         f"(attention classes found: {sorted(kinds)})")


def teacher_grid(teacher: nn.Module) -> tuple[int, int]:
    """The patch grid ``(Gh, Gw)`` of the teacher at its own image size."""
    return tuple(int(g) for g in teacher.patch_embed.grid_size)


def _student_config(config: Mapping[str, Any], mixer: str, options: Mapping[str, Any]) -> dict[str, Any]:
    from ssogvit.models import parse_model_name

    family, size, _ = parse_model_name(config["name"])
    out = {k: v for k, v in config.items() if k not in ("fused", "attn_drop")}  # MHA-only options
    if "qkv_bias" in out:
        out["bias"] = out.pop("qkv_bias")
    out.update(options)
    out["name"] = f"{family}-{size}-{mixer}"
    return out


def build_student(teacher: nn.Module, *, mixer: str = "ssog", **mixer_options: Any) -> nn.Module:
    """The SSoG twin of ``teacher``: same family, width, depth, grid, prefix tokens and classes; every weight but
    the queries and keys carried over by ``ssogify``; the Gaussian fields at their default initialisation.

    Args:
        teacher: a ViT of ours with an MHA mixer, or a timm ViT that ``ssogify`` accepts.
        mixer: ``"ssog"`` (fixed field) or ``"ssog-steered"``.
        **mixer_options: ``SSoGAttention`` options (``num_atoms``, ``steer``, ``radius``, ``gate_init``, ...).

    Raises:
        ValueError: a teacher that is not a multi-head-attention ViT, an option that would change the architecture,
            or an attention ``ssogify`` cannot carry.
    """
    check_teacher(teacher)
    changed = sorted(set(mixer_options) & set(ARCHITECTURE_KEYS))
    if changed:
        have = {k: getattr(teacher, k, None) for k in changed}
        raise ValueError(f"conversion keeps the teacher's architecture; cannot set {changed} (the teacher has {have})")
    carried = ssogify(copy.deepcopy(teacher), mixer=mixer, **mixer_options)
    if not hasattr(teacher, "config"):  # timm: the ssogified copy is the student
        recipe = {"mixer": mixer, "mixer_options": dict(mixer_options)}
        carried.config_timm = {**getattr(teacher, "config_timm", {}), **recipe}
        return carried.train(teacher.training)
    from ssogvit.train.io import build_model

    student = build_model(_student_config(teacher.config, mixer, mixer_options))
    student.load_state_dict(carried.state_dict(), strict=True)
    return student.train(teacher.training)


def load_converted(path: str | Path) -> nn.Module:
    """A converted model from its export (``.safetensors`` with its ``.json``), in eval mode.

    A student of ours loads like any trained model (``ssogvit.train.io.load_model``); a converted timm ViT is rebuilt
    with ``timm.create_model`` and ``ssogify`` from the recipe in the ``.json``.
    """
    from ssogvit.train.io import load_model, read_sealed

    state, meta = read_sealed(path, ours=False)  # the recipe sealed with the weights, the .json beside it checked
    if _TIMM_KEY not in meta:
        return load_model(path)
    import timm

    model = timm.create_model(meta[_TIMM_KEY], pretrained=False, **meta["timm_kwargs"])
    ssogify(model, mixer=meta["mixer"], **meta["mixer_options"])
    model.load_state_dict(state, strict=True)
    model.config_timm = meta
    return model.eval()


@contextmanager
def record_mixer_inputs(model: nn.Module) -> Iterator[list[tuple[int, Tensor]]]:
    """Record ``(block index, mixer input (B, T, D))`` for every call of every ``blocks[i].attn``, in call order.

    The inputs keep their autograd history (a student's features are trained on). A looped model calls its one
    mixer ``T`` times and an ODE model once per solver evaluation: each call is one record.
    """
    records: list[tuple[int, Tensor]] = []
    handles = [
        block.attn.register_forward_pre_hook(lambda mod, args, i=i: records.append((i, args[0])))
        for i, block in enumerate(unique_blocks(model))
    ]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


@contextmanager
def record_block_outputs(model: nn.Module) -> Iterator[list[Tensor]]:
    """Record the token output ``(B, T, D)`` of every call of every ``blocks[i]``, in call order, with its autograd
    history. (An ODE model applies its block through ``vector_field``, which records nothing.)"""
    records: list[Tensor] = []

    def hook(mod: nn.Module, args: tuple, out: Any) -> None:
        records.append(out[0] if isinstance(out, tuple) else out)  # ours return (tokens, attn), timm's tokens

    handles = [block.register_forward_hook(hook) for block in unique_blocks(model)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def attention_probs(attn: nn.Module, x: Tensor) -> Tensor:
    """``softmax(q k^T * scale)`` ``(B, H, T, T)`` of a multi-head attention (``qkv``, optional ``q_norm``/``k_norm``,
    ``scale``: ours and timm's) on its input ``x`` ``(B, T, D)``."""
    b, t, d = x.shape
    h = attn.num_heads
    q, k, _ = attn.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, dh)
    q = getattr(attn, "q_norm", nn.Identity())(q)
    k = getattr(attn, "k_norm", nn.Identity())(k)
    return torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1)
