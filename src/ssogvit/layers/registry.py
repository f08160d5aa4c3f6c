"""One registry of token mixers, so that "the only change is the mixer" is a string in a config."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ssogvit.layers.attention import Attention
from ssogvit.layers.linear import LinearAttention
from ssogvit.layers.neighborhood import NeighborhoodAttention
from ssogvit.layers.ssog import STEER_PATHS, SSoGAttention
from ssogvit.layers.window import WindowAttention

__all__ = ["MIXERS", "create_mixer", "list_mixers", "mixer_options", "mixer_option_defaults", "default_pool"]

# name -> (class, defaults that define the name)
MIXERS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "mha": (Attention, {"fused": True}),
    "mha-unfused": (Attention, {"fused": False}),
    "ssog": (SSoGAttention, {"steer": ()}),
    "ssog-steered": (SSoGAttention, {"steer": STEER_PATHS}),
    "window": (WindowAttention, {}),
    "neighborhood": (NeighborhoodAttention, {}),
    "linear": (LinearAttention, {}),
}


def list_mixers() -> list[str]:
    """Names accepted by ``create_mixer``."""
    return list(MIXERS)


def mixer_options(name: str) -> list[str]:
    """Keyword options the named mixer accepts (besides ``dim`` and ``num_heads``)."""
    cls, _ = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "dim", "num_heads")]


def mixer_option_defaults(name: str) -> dict[str, Any]:
    """The value each keyword option of the named mixer takes when not given: the name's own (``"ssog-steered"``
    steers) or the class's default."""
    cls, preset = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    return {p: preset.get(p, v.default) for p, v in params.items()
            if p not in ("self", "dim", "num_heads") and v.default is not inspect.Parameter.empty}


def default_pool(name: str) -> str:
    """The classifier head that suits the named mixer (its class's ``default_pool``): a model's ``global_pool`` when
    none is given."""
    cls, _ = _lookup(name)
    return cls.default_pool


def _lookup(name: str) -> tuple[type[nn.Module], dict[str, Any]]:
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; expected one of {list_mixers()}")
    return MIXERS[name]


def create_mixer(name: str, dim: int, num_heads: int, **options: Any) -> nn.Module:
    """Build a token mixer by name.

    Args:
        name: one of ``list_mixers()``: ``"mha"``, ``"mha-unfused"``, ``"ssog"``, ``"ssog-steered"``, and the
            attention users pick at high resolution: ``"window"`` (``window_size``, ``shift_size``),
            ``"neighborhood"`` (``kernel_size``, ``impl``), ``"linear"`` (docs/models.md).
        dim: token width.
        num_heads: number of heads.
        **options: keyword options of the mixer class (``mixer_options(name)`` lists them). ``"ssog-steered"``
            steers all three paths unless ``steer`` says otherwise.

    Raises:
        ValueError: unknown name, or an option the mixer does not take (the message lists the valid ones).
    """
    cls, defaults = _lookup(name)
    valid = mixer_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"mixer {name!r} does not take option(s) {unknown}; valid options: {valid}")
    if name == "ssog-steered" and options.get("steer", STEER_PATHS) in ((), None, "none"):
        raise ValueError("mixer 'ssog-steered' needs at least one steering path; use mixer 'ssog' for the fixed field")
    ctor: Callable[..., nn.Module] = cls
    return ctor(dim, num_heads, **{**defaults, **options})
