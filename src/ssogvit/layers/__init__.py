"""Token mixers: SSoG and its attention baselines, built by name with ``create_mixer``."""

from ssogvit.layers.attention import Attention
from ssogvit.layers.registry import MIXERS, create_mixer, list_mixers, mixer_options
from ssogvit.layers.ssog import SSOG_IMPLS, STEER_PATHS, SSoGAttention, is_ssog

__all__ = [
    "Attention",
    "SSoGAttention",
    "MIXERS",
    "SSOG_IMPLS",
    "STEER_PATHS",
    "create_mixer",
    "is_ssog",
    "list_mixers",
    "mixer_options",
]
