"""Continuous-depth ODE-ViT (Boned Riera et al. 2025; docs/models.md).

Tokens evolve under the autonomous field ``dz/dt = f(z) = s * (Mixer(N1(z)) + MLP(N2(z)))`` over ``t in [0, 1]``,
integrated with ``torchdiffeq``. The default, explicit Euler on a uniform grid of ``NFE + 1`` points with ``s = NFE``,
is exactly a stack of ``NFE`` residual steps ``z <- z + Mixer(N1(z)) + MLP(N2(z))`` sharing one set of weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torchdiffeq import odeint, odeint_adjoint

from ssogvit.specs import AppliesOnly, Flag, Float, Text, check_args

from ._common import Block, CenterNorm, VisionTransformerBase, layer_norm

__all__ = ["ODEViT", "Flow", "FIXED_GRID_SOLVERS", "ADAPTIVE_SOLVERS", "NORMS", "STEPPED_SOLVERS", "STEPS"]

#: torchdiffeq solvers that step on the given uniform grid (``depth`` steps).
FIXED_GRID_SOLVERS = ("euler", "midpoint", "heun2", "heun3", "rk4", "explicit_adams", "implicit_adams")
#: torchdiffeq solvers that choose their own steps from ``rtol`` / ``atol`` (``depth`` only sets the default scale).
ADAPTIVE_SOLVERS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
#: norm option -> constructor for the two norms ``N1``, ``N2`` inside the field.
NORMS = {"layernorm": layer_norm, "centernorm": CenterNorm}
#: the family's own options, declared (``ssogvit.specs``); solver and norm names are checked against the lists above
OPTION_SPECS = {"solver": Text(), "norm": Text(), "scale": Float(0, low_open=True, none=True),
                "rtol": Float(0, low_open=True), "atol": Float(0, low_open=True), "adjoint": Flag()}


def _euler(f: Callable[[Tensor], Tensor], dt: Tensor, z: Tensor) -> Tensor:
    return dt * f(z)


def _midpoint(f: Callable[[Tensor], Tensor], dt: Tensor, z: Tensor) -> Tensor:
    half_dt = 0.5 * dt
    return dt * f(z + f(z) * half_dt)


def _heun2(f: Callable[[Tensor], Tensor], dt: Tensor, z: Tensor) -> Tensor:
    k1 = f(z)
    k2 = f(z + dt * k1)
    return dt * (k1 * 0.5 + k2 * 0.5)


def _heun3(f: Callable[[Tensor], Tensor], dt: Tensor, z: Tensor) -> Tensor:
    k1 = f(z)
    k2 = f(z + dt * k1 * (1 / 3))
    k3 = f(z + dt * (k2 * (2 / 3)))
    return dt * (k1 * 0.25 + k3 * 0.75)


def _rk4(f: Callable[[Tensor], Tensor], dt: Tensor, z: Tensor) -> Tensor:
    """The 3/8 rule, which is torchdiffeq's ``"rk4"``."""
    k1 = f(z)
    k2 = f(z + dt * k1 * (1 / 3))
    k3 = f(z + dt * (k2 - k1 * (1 / 3)))
    k4 = f(z + dt * (k1 - k2 + k3))
    return (k1 + 3 * (k2 + k3) + k4) * dt * 0.125


#: The fixed-grid solvers whose steps are self-contained, by torchdiffeq's method name: ``step(f, dt, z)`` is the
#: increment of one step of length ``dt`` of the autonomous field ``f`` (the same Butcher tableaux as torchdiffeq's
#: methods of those names; ``tests/test_ode.py`` compares them with ``torchdiffeq.odeint``, forward and gradient). The
#: model takes them one grid interval at a time, so each step is one block application to timm (intermediates,
#: checkpointing) and the forward has no data-dependent control flow (torch.export, ONNX). The other solvers go
#: through ``odeint`` whole.
STEPS: dict[str, Callable[[Callable[[Tensor], Tensor], Tensor, Tensor], Tensor]] = {
    "euler": _euler, "midpoint": _midpoint, "heun2": _heun2, "heun3": _heun3, "rk4": _rk4,
}
STEPPED_SOLVERS = tuple(STEPS)


class _Field(nn.Module):
    """``f(t, z)`` for torchdiffeq: the block's parallel form on tokens over ``grid``, scaled; counts its
    evaluations. One is made per solve, so the grid is that solve's own."""

    def __init__(self, block: Block, scale: float, grid: tuple[int, int]) -> None:
        super().__init__()
        self.block = block
        self.scale = scale
        self.grid = grid
        self.calls = 0

    def forward(self, t: Tensor | None, z: Tensor) -> Tensor:
        # autonomous: t unused (the model's own steps pass None)
        self.calls += 1
        return self.scale * self.block.vector_field(z, self.grid)


class Flow(nn.Module):
    """One block's field integrated over ``[t_start, t_stop]`` of a uniform grid of ``total`` steps on ``[0, 1]``.

    To timm the flow is a sequence of its grid steps: ``flow[i]`` integrates step ``i`` alone, ``flow[:k]`` the first
    ``k`` steps, so an intermediate of ``forward_intermediates`` is the state at a grid time ``t_k = k / depth``. That
    holds for the ``STEPPED_SOLVERS`` without adjoint, whose full solve is exactly the composition of its steps; for
    the others a step cannot be taken alone, and indexing or iterating the flow is a ``ValueError``. The block is
    stored once (state-dict keys ``blocks.0.*``).
    """

    def __init__(
        self, block: Block, *, total: int, solver: str, scale: float, rtol: float, atol: float, adjoint: bool,
        start: int = 0, stop: int | None = None, counter: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.add_module("0", block)
        self.total, self.solver, self.scale = total, solver, scale
        self.rtol, self.atol, self.adjoint = rtol, atol, adjoint
        self.start, self.stop = start, total if stop is None else stop
        self.counter = [0] if counter is None else counter

    @property
    def block(self) -> Block:
        return self._modules["0"]

    @property
    def stepped(self) -> bool:
        """Whether the solve runs as separate grid steps (see the class docstring)."""
        return self.solver in STEPPED_SOLVERS and not self.adjoint

    def __len__(self) -> int:
        return self.stop - self.start

    def require_steps(self) -> None:
        """A ``ValueError`` saying why where the solve cannot be split into grid steps (``stepped``)."""
        if not self.stepped:
            why = "the adjoint method solves the whole interval" if self.adjoint else "its steps are not self-contained"
            raise ValueError(
                f"the ODE solve with solver {self.solver!r} cannot be split into grid steps ({why}); intermediates, "
                f"pruning and gradient checkpointing need one of {STEPPED_SOLVERS} without adjoint"
            )

    def _view(self, start: int, stop: int) -> Flow:
        self.require_steps()
        return Flow(
            self.block, total=self.total, solver=self.solver, scale=self.scale, rtol=self.rtol, atol=self.atol,
            adjoint=self.adjoint, start=start, stop=stop, counter=self.counter,
        )

    def __getitem__(self, index: int | slice) -> Flow:
        steps = range(self.start, self.stop)[index]  # IndexError out of range
        if isinstance(steps, int):
            return self._view(steps, steps + 1)
        if steps.step != 1:
            raise ValueError(f"ODE steps are contiguous; got the slice {index}")
        return self._view(steps.start, steps.stop)

    def __iter__(self) -> Iterator[Flow]:
        return iter([self[i] for i in range(len(self))])

    def time_grid(self, like: Tensor) -> Tensor:
        """The uniform grid ``t_k = k / total`` (float64 for float64 tokens, else float32)."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return torch.linspace(0.0, 1.0, self.total + 1, dtype=dtype, device=like.device)

    def forward(self, z: Tensor, grid: tuple[int, int]) -> Tensor:
        """Integrate tokens ``z (B, P + Gh*Gw, D)`` over the patch grid ``grid`` from ``t_start`` to ``t_stop``."""
        field = _Field(self.block, self.scale, grid)
        t = self.time_grid(z)
        if self.stepped:
            step, f = STEPS[self.solver], lambda y: field(None, y)
            for k in range(self.start, self.stop):
                z = z + step(f, t[k + 1] - t[k], z)
        else:
            if self.solver in ADAPTIVE_SOLVERS:
                t = t[[0, -1]]  # the solver chooses its own steps
            kwargs = dict(rtol=self.rtol, atol=self.atol, method=self.solver)
            if self.adjoint:
                z = odeint_adjoint(field, z, t, adjoint_params=tuple(field.parameters()), **kwargs)[-1]
            else:
                z = odeint(field, z, t, **kwargs)[-1]
        # evaluations of the forward solve (a later adjoint backward does not count)
        self.counter[0] = field.calls if self.start == 0 else self.counter[0] + field.calls
        return z

    def extra_repr(self) -> str:
        return f"steps={self.start}..{self.stop} of {self.total}, solver={self.solver}, scale={self.scale}"


class ODEViT(VisionTransformerBase):
    """Continuous-depth ViT with one block's weights as an autonomous vector field.

    The shared options are the base's (``VisionTransformerBase``); ``depth`` is the number of steps of the uniform
    time grid (``NFE`` for Euler; ``rk4`` makes 4 evaluations per step; for adaptive solvers it only sets the default
    ``scale``) and ``drop_path_rate`` must be 0 (stochastic depth has no meaning inside an ODE solve). The family's
    own options (``family_options``):

    - ``solver``: a torchdiffeq method, one of ``FIXED_GRID_SOLVERS + ADAPTIVE_SOLVERS``;
    - ``scale``: ``s`` in ``f``; ``None`` means ``depth``, so Euler reproduces a residual stack;
    - ``norm``: ``"layernorm"`` or ``"centernorm"`` for ``N1``, ``N2`` (the final norm is always LayerNorm);
    - ``rtol``, ``atol``: tolerances of adaptive solvers;
    - ``adjoint``: backpropagate with the adjoint method (``odeint_adjoint``), constant memory in the number of steps.

    After each forward, ``nfe`` holds the number of evaluations of ``f`` that the forward solve made. ``blocks`` is a
    ``Flow``: to timm's API the ``depth`` grid steps are the model's blocks (an intermediate is the state at
    ``t_k = k / depth``), for the ``STEPPED_SOLVERS`` without adjoint.
    """

    family = "ode"
    family_options = dict(solver="euler", scale=None, norm="layernorm", rtol=1e-3, atol=1e-4, adjoint=False)
    #: an adaptive solver's tolerances: a fixed-grid solver takes ``depth`` steps whatever they say
    option_applies = dict.fromkeys(("rtol", "atol"), AppliesOnly(
        lambda o: o["solver"] in ADAPTIVE_SOLVERS,
        f"an adaptive solver (solver= one of {', '.join(ADAPTIVE_SOLVERS)})"))
    shared_block = True

    def _check_options(self, options: dict[str, Any], *, drop_path_rate: float) -> dict[str, Any]:
        options = check_args(OPTION_SPECS, options)
        solver, norm = options["solver"], options["norm"]
        if solver not in FIXED_GRID_SOLVERS + ADAPTIVE_SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; expected one of {FIXED_GRID_SOLVERS + ADAPTIVE_SOLVERS}")
        if norm.lower() not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; expected one of {tuple(NORMS)}")
        if drop_path_rate:
            raise ValueError("drop_path_rate is not supported by the ode family (must be 0)")
        return {**options, "norm": norm.lower()}

    def _block_norm(self, options: dict[str, Any]) -> Callable[[int], nn.Module]:
        return NORMS[options["norm"]]

    def _steps(self, blocks: nn.Sequential, *, drop_path_rate: float) -> Flow:
        scale = self.config["scale"]
        return self._flow(blocks[0], self.depth, float(self.depth if scale is None else scale))

    def _flow(self, block: Block, depth: int, scale: float) -> Flow:
        c = self.config
        return Flow(block, total=depth, solver=c["solver"], scale=scale, rtol=c["rtol"], atol=c["atol"],
                    adjoint=c["adjoint"])

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's; checkpointing runs the solve step by step, so a solve that cannot be split is refused here, at
        the call, rather than at the next forward."""
        if enable:
            self.blocks.require_steps()
        super().set_grad_checkpointing(enable)

    def _set_depth(self, depth: int) -> None:
        # The first ``depth`` of ``total`` steps integrate to t = depth / total: the same flow as ``depth`` steps on
        # [0, 1] with the scale multiplied by depth / total (so ``create_model(**config)`` rebuilds the pruned model).
        self.config["scale"] = self.scale * depth / self.blocks.total
        self.blocks = self._flow(self.blocks.block, depth, self.config["scale"])
        super()._set_depth(depth)

    # the family's options, as the flow holds them
    solver = property(lambda self: self.blocks.solver, doc="The torchdiffeq method.")
    scale = property(lambda self: self.blocks.scale, doc="``s`` in ``f``.")
    rtol = property(lambda self: self.blocks.rtol, doc="Relative tolerance of adaptive solvers.")
    atol = property(lambda self: self.blocks.atol, doc="Absolute tolerance of adaptive solvers.")
    adjoint = property(lambda self: self.blocks.adjoint, doc="Whether the backward uses the adjoint method.")
    norm_name = property(lambda self: self.config["norm"], doc="The norm of ``N1``, ``N2`` in the field.")

    @property
    def nfe(self) -> int:
        """Evaluations of ``f`` in the latest forward solve."""
        return self.blocks.counter[0]

    def time_grid(self, like: Tensor) -> Tensor:
        """The uniform time grid: ``depth + 1`` points on ``[0, 1]`` (adaptive solvers use only its ends)."""
        return self.blocks.time_grid(like)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, solver={self.solver}, scale={self.scale}, norm={self.norm_name}, "
            f"adjoint={self.adjoint}"
        )
