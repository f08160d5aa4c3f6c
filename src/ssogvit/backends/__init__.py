"""Implementations of the SSoG mixing behind ``ssogvit.ops`` (docs/operator.md, "Backends").

``torch``: the stacked / loop / einsum fixed mixing and the steered mixing; ``triton``: the fused fixed-mixing kernel
(Triton is imported on first use only, never by ``import ssogvit``); ``_common``: what both share. Import them by
name (``from ssogvit.backends import torch as torch_backend``); this package imports nothing itself.
"""
