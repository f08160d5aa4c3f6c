"""Helpers shared by the analyses: which mixers a model has, its grid, capturing mixer inputs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from timm.layers import to_2tuple
from torch import nn

from ssogvit.layers import is_ssog


def is_steered(mixer: nn.Module) -> bool:
    """True for an SSoG mixer with at least one steering path switched on."""
    return is_ssog(mixer) and bool(mixer.steer)


def mixer_grid(model: nn.Module, img_size=None) -> tuple[int, int]:
    """`(Gh, Gw)` of `model` at its own (or the given) image size."""
    h, w = to_2tuple(img_size if img_size is not None else model.img_size)
    ph, pw = to_2tuple(model.patch_size)
    return h // ph, w // pw


def mixer_rows(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(label, mixer)` for each distinct mixer, in order: one per block, one shared for looped and ODE models."""
    mixers = list(model.mixers())
    family = getattr(model, "family", "vit")
    if family != "vit" and len(mixers) == 1:
        return [(f"shared block ({family})", mixers[0])]
    return [(f"block {i}", m) for i, m in enumerate(mixers)]


def untrained_field_mixers(model: nn.Module) -> set[int]:
    """Indices (in `model.mixers()`) of SSoG mixers whose field no loss on the logits can train: in a discrete model
    with a class-token head, the last block's (its patch outputs are never read; docs/models.md, "A structural fact of
    SSoG with a class-token head"). Empty for looped and ODE models, for `global_pool="avg"` and for the encoder of a
    segmentation model (`segmentation` set by `ssogvit analyze`: its pyramid reads the last block's patches,
    docs/dense.md)."""
    mixers = list(model.mixers())
    if (getattr(model, "family", "vit") != "vit" or getattr(model, "global_pool", "token") != "token" or not mixers
            or getattr(model, "segmentation", False)):
        return set()
    return {len(mixers) - 1} if is_ssog(mixers[-1]) else set()


UNTRAINED_NOTE = "field untrained (class-token head)"


@contextmanager
def capture_mixer_inputs(model: nn.Module) -> Iterator[list[list[tuple[torch.Tensor, tuple[int, int]]]]]:
    """Record `(x, grid)` of every call of every mixer while the context is open: `records[i]` for mixer `i`."""
    mixers = list(model.mixers())
    records: list[list] = [[] for _ in mixers]
    handles = []
    for i, m in enumerate(mixers):
        def hook(mod, args, kwargs, i=i):
            grid = kwargs.get("grid", args[1] if len(args) > 1 else None)
            records[i].append((args[0].detach(), tuple(grid)))
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
