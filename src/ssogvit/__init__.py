"""ssogvit: vision Transformers with separable sum-of-Gaussians (SSoG) token mixing.

The operator (``ssogvit.ops``), its dense reference (``ssogvit.reference``), the mixers (``SSoGAttention``,
``Attention``, ``create_mixer``), the model families (``create_model``) and the drop-in for timm (``ssogify``).
"""

from ssogvit.layers import SSOG_IMPLS, STEER_PATHS, Attention, SSoGAttention, create_mixer, list_mixers
from ssogvit.models import create_model, list_models  # also registers the models with timm
from ssogvit.timm_compat import ssogify

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "SSoGAttention",
    "SSOG_IMPLS",
    "STEER_PATHS",
    "create_mixer",
    "create_model",
    "list_mixers",
    "list_models",
    "ssogify",
    "__version__",
]

