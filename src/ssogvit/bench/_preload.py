"""Imported once by the fork server that starts benchmark points, so that each point does not pay for it."""

import torch  # noqa: F401

import ssogvit.bench._worker  # noqa: F401
import ssogvit.bench.flops  # noqa: F401
import ssogvit.bench.memory  # noqa: F401

try:  # the model families pull in timm, torchvision and torchdiffeq: the slowest imports
    import ssogvit.layers  # noqa: F401
    import ssogvit.models  # noqa: F401
except Exception:  # noqa: BLE001 - a broken import shows up in the point that needs it, with its message
    pass
