"""Attention maps for diagnostics, recorded from outside the forward pass (like timm's ``AttentionExtract``).

    with record_attention(model) as maps:
        logits = model(images)
    # maps: one (B, H, T, T) row-stochastic matrix per mixer application, in forward order

Blocks and mixers return tensors only; each mixer says which dense matrix it applies (``attention_matrix``: SSoG's
built by ``ssogvit.reference``, MHA's explicit softmax), and a forward hook records it for every call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

__all__ = ["record_attention"]


@contextmanager
def record_attention(model: nn.Module) -> Iterator[list[Tensor]]:
    """Record the dense mixing matrix of every mixer call inside ``model`` while the context is open.

    Args:
        model: any module whose mixers have ``attention_matrix(x, grid)`` (``SSoGAttention``, ``Attention``).

    Yields:
        A list that fills with one ``(B, H, T, T)`` matrix per mixer application, in order. The matrices are
        differentiable functions of the mixer's input and parameters (the JaSMin penalty trains through them).

    Raises:
        ValueError: the model has no mixer with ``attention_matrix``.
    """
    maps: list[Tensor] = []

    def hook(mixer: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        grid = kwargs.get("grid", args[1] if len(args) > 1 else None)
        prefix = kwargs.get("num_prefix_tokens")
        maps.append(mixer.attention_matrix(args[0] if args else kwargs["x"], grid, num_prefix_tokens=prefix))

    mixers = [m for m in model.modules() if callable(getattr(m, "attention_matrix", None))]
    if not mixers:
        raise ValueError(f"{type(model).__name__} has no mixer with an attention_matrix to record")
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in mixers]
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()
