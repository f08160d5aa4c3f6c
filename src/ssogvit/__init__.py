"""ssogvit: vision Transformers with separable sum-of-Gaussians (SSoG) token mixing.

The operator (``ssogvit.ops``), its dense reference (``ssogvit.reference``), the mixers (``SSoGAttention``,
``Attention``, ``create_mixer``), the model families (``create_model``) and the drop-in for timm (``ssogify``).
"""

from ssogvit.layers import SSOG_IMPLS, STEER_PATHS, Attention, SSoGAttention, create_mixer, list_mixers
from ssogvit.timm_compat import ssogify

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "SSoGAttention",
    "SSOG_IMPLS",
    "STEER_PATHS",
    "create_mixer",
    "list_mixers",
    "ssogify",
    "__version__",
]


def __getattr__(name: str):
    # models import timm layers and torchdiffeq; loaded on first use
    if name in ("create_model", "list_models"):
        from ssogvit import models

        return getattr(models, name)
    raise AttributeError(f"module 'ssogvit' has no attribute {name!r}")
