"""Continuous-depth ODE-ViT (Boned Riera et al. 2025; SPEC section 6).

Tokens evolve under the autonomous field ``dz/dt = f(z) = s * (Mixer(N1(z)) + MLP(N2(z)))`` over ``t in [0, 1]``,
integrated with ``torchdiffeq``. The default, explicit Euler on a uniform grid of ``NFE + 1`` points with ``s = NFE``,
is exactly a stack of ``NFE`` residual steps ``z <- z + Mixer(N1(z)) + MLP(N2(z))`` sharing one set of weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchdiffeq import odeint, odeint_adjoint

from ._common import Block, CenterNorm, VisionTransformerBase, layer_norm

__all__ = ["ODEViT", "FIXED_GRID_SOLVERS", "ADAPTIVE_SOLVERS", "NORMS"]

#: torchdiffeq solvers that step on the given uniform grid (``depth`` steps).
FIXED_GRID_SOLVERS = ("euler", "midpoint", "heun2", "heun3", "rk4", "explicit_adams", "implicit_adams")
#: torchdiffeq solvers that choose their own steps from ``rtol`` / ``atol`` (``depth`` only sets the default scale).
ADAPTIVE_SOLVERS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
#: norm option -> constructor for the two norms ``N1``, ``N2`` inside the field.
NORMS = {"layernorm": layer_norm, "centernorm": CenterNorm}


class _Field(nn.Module):
    """``f(t, z)`` for torchdiffeq: the block's parallel form, scaled; counts its evaluations."""

    def __init__(self, block: Block, grid: tuple[int, int], scale: float, attns: list[Tensor] | None) -> None:
        super().__init__()
        self.block = block
        self.grid = grid
        self.scale = scale
        self.attns = attns
        self.calls = 0

    def forward(self, t: Tensor, z: Tensor) -> Tensor:
        self.calls += 1
        f, attn = self.block.vector_field(z, self.grid, return_attn=self.attns is not None)
        if self.attns is not None:
            self.attns.append(attn)
        return self.scale * f


class ODEViT(VisionTransformerBase):
    """Continuous-depth ViT with one block's weights as an autonomous vector field.

    Args:
        embed_dim: token width ``D``.
        num_heads: heads ``H``.
        depth: steps of the uniform time grid (``NFE`` for Euler; ``rk4`` makes 4 evaluations per step). For adaptive
            solvers it only sets the default ``scale``.
        mixer: mixer name from the mixer registry.
        mixer_options: keyword options passed to ``create_mixer``.
        img_size: training image size (int or ``(H, W)``).
        patch_size: square patch side.
        in_chans: image channels.
        num_classes: classes of the linear head (0: no head).
        num_registers: register tokens after the class token.
        global_pool: what the head reads: ``"token"`` the class token, ``"avg"`` the mean of the normalised patch
            tokens (class and register tokens excluded).
        drop_path_rate: must be 0 (stochastic depth has no meaning inside an ODE solve).
        mlp_ratio: MLP hidden width over ``D``.
        solver: a torchdiffeq method, one of ``FIXED_GRID_SOLVERS + ADAPTIVE_SOLVERS``.
        scale: ``s`` in ``f``; ``None`` means ``depth``, so Euler reproduces a residual stack.
        norm: ``"layernorm"`` or ``"centernorm"`` for ``N1``, ``N2`` (the final norm is always LayerNorm).
        rtol: relative tolerance of adaptive solvers.
        atol: absolute tolerance of adaptive solvers.
        adjoint: backpropagate with the adjoint method (``odeint_adjoint``), constant memory in the number of steps.
        name: registry name recorded in ``config``.

    After each forward, ``nfe`` holds the number of evaluations of ``f`` that the forward solve made.
    """

    family = "ode"

    def __init__(
        self,
        *,
        embed_dim: int = 768,
        num_heads: int = 12,
        depth: int = 12,
        mixer: str = "mha",
        mixer_options: dict[str, Any] | None = None,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        num_registers: int = 0,
        global_pool: str = "token",
        drop_path_rate: float = 0.0,
        mlp_ratio: float = 4.0,
        solver: str = "euler",
        scale: float | None = None,
        norm: str = "layernorm",
        rtol: float = 1e-3,
        atol: float = 1e-4,
        adjoint: bool = False,
        name: str | None = None,
    ) -> None:
        if solver not in FIXED_GRID_SOLVERS + ADAPTIVE_SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; expected one of {FIXED_GRID_SOLVERS + ADAPTIVE_SOLVERS}")
        norm_key = norm.lower()
        if norm_key not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; expected one of {tuple(NORMS)}")
        if drop_path_rate:
            raise ValueError("drop_path_rate is not supported by the ode family (must be 0)")
        if not (rtol > 0 and atol > 0):
            raise ValueError(f"rtol and atol must be > 0, got rtol={rtol}, atol={atol}")
        config = dict(
            embed_dim=embed_dim, num_heads=num_heads, depth=depth, img_size=img_size, patch_size=patch_size,
            in_chans=in_chans, num_classes=num_classes, num_registers=num_registers, global_pool=global_pool,
            drop_path_rate=drop_path_rate, mlp_ratio=mlp_ratio, solver=solver, scale=scale, norm=norm_key, rtol=rtol,
            atol=atol, adjoint=adjoint,
            **(mixer_options or {}),
        )
        super().__init__(
            embed_dim=embed_dim, num_heads=num_heads, depth=depth, mixer=mixer, mixer_options=mixer_options,
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
            num_registers=num_registers, global_pool=global_pool, name=name, config=config,
        )
        self.solver = solver
        self.scale = float(depth if scale is None else scale)
        self.norm_name = norm_key
        self.rtol = rtol
        self.atol = atol
        self.adjoint = adjoint
        self.nfe = 0
        self.blocks = nn.ModuleList([self._make_block(mlp_ratio=mlp_ratio, norm_layer=NORMS[norm_key])])
        self._init_weights()

    def time_grid(self, like: Tensor) -> Tensor:
        """Output times for the solver: ``depth + 1`` uniform points on ``[0, 1]``, or ``[0, 1]`` if adaptive."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        points = 2 if self.solver in ADAPTIVE_SOLVERS else self.depth + 1
        return torch.linspace(0.0, 1.0, points, dtype=dtype, device=like.device)

    def _forward_tokens(self, z: Tensor, grid: tuple[int, int], attns: list[Tensor] | None) -> Tensor:
        field = _Field(self.blocks[0], grid, self.scale, attns)
        t = self.time_grid(z)
        kwargs = dict(rtol=self.rtol, atol=self.atol, method=self.solver)
        if self.adjoint:
            path = odeint_adjoint(field, z, t, adjoint_params=tuple(field.parameters()), **kwargs)
        else:
            path = odeint(field, z, t, **kwargs)
        self.nfe = field.calls
        return path[-1]

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, solver={self.solver}, scale={self.scale}, norm={self.norm_name}, "
            f"adjoint={self.adjoint}"
        )
