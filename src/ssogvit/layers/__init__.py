"""Token mixers: SSoG and its attention baselines (dense, window, neighbourhood, linear), built by name with
``create_mixer``."""

from ssogvit.layers.attention import Attention
from ssogvit.layers.linear import LinearAttention
from ssogvit.layers.neighborhood import NEIGHBORHOOD_IMPLS, NeighborhoodAttention
from ssogvit.layers.registry import (
    MIXERS,
    create_mixer,
    default_pool,
    list_mixers,
    mixer_option_defaults,
    mixer_options,
)
from ssogvit.layers.ssog import SSOG_IMPLS, STEER_PATHS, SSoGAttention, is_ssog
from ssogvit.layers.window import WindowAttention

__all__ = [
    "Attention",
    "LinearAttention",
    "NeighborhoodAttention",
    "SSoGAttention",
    "WindowAttention",
    "MIXERS",
    "NEIGHBORHOOD_IMPLS",
    "SSOG_IMPLS",
    "STEER_PATHS",
    "create_mixer",
    "default_pool",
    "is_ssog",
    "list_mixers",
    "mixer_option_defaults",
    "mixer_options",
]
