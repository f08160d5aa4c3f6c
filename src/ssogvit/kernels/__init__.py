"""Optional fused GPU kernels. Nothing here imports Triton at import time: ``import ssogvit`` works without it.

``triton_available()`` says whether the Triton path can run (Triton imports and kernels compile for the device, or
the Triton interpreter is on: ``TRITON_INTERPRET=1`` set before the first use).
"""

from __future__ import annotations

from ssogvit.kernels.triton_ssog import ssog_mix_triton, triton_available, triton_import_error, triton_usable

__all__ = ["ssog_mix_triton", "triton_available", "triton_usable", "triton_import_error"]
