"""``SSoGAttention``: the SSoG token mixer as a drop-in replacement for multi-head attention (docs/operator.md)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, ClassVar

import torch
from torch import Tensor, nn

from ssogvit import core, ops, reference
from ssogvit.backends import cpu
from ssogvit.backends.torch import default_head_chunk
from ssogvit.errors import InputError
from ssogvit.specs import DROP_RATE, EMBED_DIM, GRID_RATIO, NUM_HEADS, AppliesOnly, Choice, Flag, Float, Int, checked

__all__ = ["SSoGAttention", "STEER_PATHS", "SSOG_IMPLS", "NUM_ATOMS", "RADIUS", "is_ssog"]

STEER_PATHS = ("mu", "sigma", "lambda")
SSOG_IMPLS = ops.SSOG_IMPLS
#: Gaussian atoms per head R
NUM_ATOMS = Int(1, 1024)
#: steering radius M in grid cells
RADIUS = Float(0, 1024, low_open=True)


def _parse_steer(steer: str | Iterable[str] | None) -> tuple[str, ...]:
    if steer is None or steer == "none":
        return ()
    if steer == "all":
        return STEER_PATHS
    if isinstance(steer, str):
        steer = [s for s in steer.replace("+", ",").split(",") if s]
    if not isinstance(steer, Iterable):
        raise ValueError(f"steer={steer!r}: expected a subset of {STEER_PATHS}, 'all' or 'none' (the mixer "
                         "'ssog-steered' steers all three)")
    steer = tuple(steer)
    unknown = [s for s in steer if s not in STEER_PATHS]
    if unknown:
        raise ValueError(f"unknown steering path(s) {unknown}; expected a subset of {STEER_PATHS} (or 'all')")
    return tuple(p for p in STEER_PATHS if p in steer)


#: the options only a steered mixer uses (the centre offsets' bound, the gates' initial value): given to a fixed
#: mixer at another value than the default, they are refused (``specs.check_applies``), not recorded and ignored
STEERED_ONLY = dict.fromkeys(("radius", "gate_init"), AppliesOnly(
    lambda a: bool(_parse_steer(a["steer"])),
    "a steered mixer (steer='mu', 'sigma', 'lambda', a list of them or 'all'; or the mixer 'ssog-steered')"))


class SSoGAttention(nn.Module):
    """Separable sum-of-Gaussians token mixer.

    Each head mixes value features through ``num_atoms`` axis-factorised Gaussian kernels over relative grid position,
    optionally steered per token by the content (``steer``). No queries or keys; the ``N x N`` matrix is never built
    on the fast path. Called as ``attn(x, grid=(Gh, Gw))`` with ``x`` of shape ``(B, P + Gh*Gw, D)``.

    Args:
        dim: token width ``D``.
        num_heads: ``H``; must divide ``dim``.
        num_atoms: Gaussian atoms per head ``R``.
        steer: steered paths, a subset of ``("mu", "sigma", "lambda")``, ``"all"`` or ``()`` for the fixed field.
        radius: steering radius ``M`` in grid cells (bound on the centre offset).
        sigma_min: lower bound on the width, in grid cells.
        tau_min: lower bound on the temperature.
        eps_sigma: added to the width.
        gate_init: initial raw gate ``alpha`` (``-8`` cold, ``-2`` warm); a float, or a mapping from path to float.
        mu_init_std: standard deviation of the initial centres.
        rho_init: initial raw width.
        theta_init: initial raw temperature.
        per_head_temperature: one temperature per head instead of one per mixer.
        bias: bias of the value projection, and of the output projection unless ``proj_bias`` says otherwise.
        proj_bias: bias of the output projection (``None``: as ``bias``).
        prefix_pool: ``"mean"`` (prefix tokens get the mean patch value) or ``"none"`` (no prefix tokens allowed).
        proj_drop: dropout after the output projection.
        impl: the backend that mixes, one of ``SSOG_IMPLS`` (``"auto"``: the first that takes the input, see
            ``ops.ssog_mix``; a backend asked for by name that cannot mix the input, ``"triton"`` on a CPU tensor or
            for the steered mixing, say, fails at call time and says why).
        head_chunk: heads per chunk: of the steered kernel tables, or of the fixed field's batched matmuls in
            inference (``None``: chosen from the problem size; see ``ops.ssog_mix``).
        cache_kernels: reuse the fixed-field kernel tables between calls while neither the parameters nor the grid
            change and no gradient is needed (inference).
    """

    #: the classifier head that suits the mixer (a model's ``global_pool`` default): the mean of the patch tokens.
    #: Patches never read prefix tokens, so a class token only receives the mean patch value and, under a class-token
    #: head, the last block's field gets no gradient (docs/models.md, "The default head").
    default_pool: ClassVar[str] = "avg"

    @checked(applies=STEERED_ONLY)
    def __init__(
        self,
        dim: Annotated[int, EMBED_DIM],
        num_heads: Annotated[int, NUM_HEADS] = 8,
        *,
        num_atoms: Annotated[int, NUM_ATOMS] = 4,
        steer: str | Iterable[str] | None = (),
        radius: Annotated[float, RADIUS] = 4.0,
        sigma_min: Annotated[float, Float(0, low_open=True)] = 0.25,
        tau_min: Annotated[float, Float(0, low_open=True)] = 0.5,
        eps_sigma: Annotated[float, Float(0)] = 1e-4,
        gate_init: float | Mapping[str, float] = -8.0,
        mu_init_std: Annotated[float, Float(0)] = 0.5,
        rho_init: Annotated[float, Float()] = -0.5,
        theta_init: Annotated[float, Float()] = -1.0,
        per_head_temperature: Annotated[bool, Flag()] = False,
        bias: Annotated[bool, Flag()] = True,
        proj_bias: Annotated[bool | None, Flag(none=True)] = None,
        prefix_pool: Annotated[str, Choice(("mean", "none"))] = "mean",
        proj_drop: Annotated[float, DROP_RATE] = 0.0,
        impl: Annotated[str, Choice(SSOG_IMPLS)] = "auto",
        head_chunk: Annotated[int | None, Int(1, none=True)] = None,
        cache_kernels: Annotated[bool, Flag()] = True,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise InputError(f"dim ({dim}) must be divisible by num_heads ({num_heads})", argument="num_heads")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.num_atoms = num_atoms
        self.steer = _parse_steer(steer)
        self.radius = float(radius)
        self.sigma_min = float(sigma_min)
        self.tau_min = float(tau_min)
        self.eps_sigma = float(eps_sigma)
        self.prefix_pool = prefix_pool
        self.impl = impl
        self.head_chunk = head_chunk
        self.cache_kernels = cache_kernels

        h, r = num_heads, num_atoms
        self.v = nn.Linear(dim, dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias if proj_bias is None else proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.mu = nn.Parameter(torch.randn(h, r, 2) * mu_init_std)
        self.rho = nn.Parameter(torch.full((h, r, 2), float(rho_init)))
        self.ell = nn.Parameter(torch.zeros(h, r))
        self.theta = nn.Parameter(torch.full((h,) if per_head_temperature else (), float(theta_init)))

        gates = dict(gate_init) if isinstance(gate_init, Mapping) else {p: gate_init for p in STEER_PATHS}
        unknown = set(gates) - set(STEER_PATHS)
        if unknown:
            raise ValueError(f"unknown gate(s) {sorted(unknown)} in gate_init; expected keys from {STEER_PATHS}")
        gates = {p: Float().check(v, f"gate_init[{p!r}]" if isinstance(gate_init, Mapping) else "gate_init")
                 for p, v in gates.items()}
        out_features = {"mu": h * r * 2, "sigma": h * r * 2, "lambda": h * r}
        for path in self.steer:
            lin = nn.Linear(dim, out_features[path])
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
            setattr(self, f"{path}_steer", lin)
            setattr(self, f"alpha_{path}", nn.Parameter(torch.tensor(float(gates.get(path, -8.0)))))
        self._kernel_cache: tuple | None = None

    # -- the field -------------------------------------------------------------------------------------------------

    def sigma(self) -> Tensor:
        """Widths ``(H, R, 2)`` in grid cells."""
        return ops.field_sigma(self.rho, self.sigma_min, self.eps_sigma)

    def tau(self) -> Tensor:
        """Temperature: a scalar, or ``(H,)`` with ``per_head_temperature``."""
        return ops.field_tau(self.theta, self.tau_min)

    def mixture(self) -> Tensor:
        """Mixture weights ``lambda`` ``(H, R)`` on the simplex."""
        return torch.softmax(self.ell, dim=-1)

    def gates(self) -> dict[str, Tensor]:
        """Steering gate values ``s = softplus(alpha) + 1e-4`` of the enabled paths."""
        return {p: ops.steer_gate(getattr(self, f"alpha_{p}")) for p in self.steer}

    def _tau_hr(self) -> Tensor:
        tau = self.tau()
        return tau[:, None] if tau.ndim else tau  # broadcastable to (H, R)

    def axis_kernels(self, grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """Fixed-field kernels ``(K^y (H, R, Gh, Gh), K^x (H, R, Gw, Gw))``."""
        gh, gw = grid
        sigma, tau = self.sigma(), self._tau_hr()
        ky = ops.axis_kernels(gh, self.mu[..., 0], sigma[..., 0], tau, impl=self.impl)
        kx = ops.axis_kernels(gw, self.mu[..., 1], sigma[..., 1], tau, impl=self.impl)
        return ky, kx

    def _tables_cached(self) -> bool:
        return (self.cache_kernels and not torch.is_grad_enabled() and not core.functional_only()
                and not torch.compiler.is_compiling())

    def _fixed_kernels(self, grid: tuple[int, int], dtype: torch.dtype, *, bands: bool = False) -> tuple:
        """``(K^y, K^x, lambda)`` in ``dtype``, and with ``bands`` the rows' (``core.field_bands`` for the working
        precision ``dtype``) as a fourth; in inference (no grad, not traced or compiled) kept until the parameters
        or the grid change. Under ``torch.compile`` the tables are always built, inside the compiled graph: the cache
        is Python state the compiler would have to guard on.

        The cache is keyed by the field parameters' values (a copy of these few numbers, compared exactly), not by
        their version counters: PyTorch's fused optimizers (``AdamW(fused=True)``) and ``.data`` writes change a
        parameter without bumping its version, which left stale tables in use."""
        use_cache = self._tables_cached()
        if use_cache:
            values = tuple(p.detach() for p in (self.mu, self.rho, self.ell, self.theta))
            cached = self._kernel_cache
            if (cached is not None and cached[0] == (tuple(grid), dtype, self.mu.device)
                    and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(cached[1], values))):
                return cached[2] if bands else cached[2][:3]
        ky, kx = self.axis_kernels(grid)
        scale = core.kernel_scale(self.sigma(), self._tau_hr()[..., None])
        tables = (ky.to(dtype), kx.to(dtype), self.mixture().to(dtype), core.field_bands(self.mu, scale, grid, dtype))
        if use_cache:
            self._kernel_cache = ((tuple(grid), dtype, self.mu.device), tuple(v.clone() for v in values), tables)
        return tables if bands else tables[:3]

    def read_entries(self, grid: tuple[int, int], dtype: torch.dtype = torch.float32) -> tuple[int, int]:
        """The fixed field's kernel entries that the C kernel reads at ``grid`` in ``dtype``, summed over heads, atoms
        and query positions, per axis ``(y, x)``: its bands' where they are narrow enough to pay
        (``backends.cpu.field_bands``; docs/operator.md, "Bands"), else whole rows (``H R Gh^2``, ``H R Gw^2``; also
        for a field without values, on the meta device)."""
        bands = None
        if not self.mu.is_meta:
            with torch.no_grad():
                scale = core.kernel_scale(self.sigma(), self._tau_hr()[..., None])
                bands = cpu.field_bands(self.mu.cpu(), scale.cpu(), tuple(grid), dtype)
        if bands is None:
            return tuple(self.num_heads * self.num_atoms * n * n for n in grid)
        return tuple(int((b[..., 1] - b[..., 0]).sum()) for b in bands)

    def _steering(self) -> tuple[Tensor, ...]:
        """The steering parameters in ``core.token_geometry``'s order: the gates' ``alpha``, then each map's weight
        and bias."""
        maps = [getattr(self, f"{p}_steer") for p in self.steer]
        return (*(getattr(self, f"alpha_{p}") for p in self.steer), *(t for m in maps for t in (m.weight, m.bias)))

    def geometry(self, x_patches: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token geometry predicted from the (normalised) patch tokens ``(B, N, D)``.

        Returns:
            ``mu (B, N, H, R, 2)``, ``sigma (B, N, H, R, 2)``, ``lambda (B, N, H, R)``; paths that are not steered
            are the fixed field broadcast over tokens.
        """
        return core.token_geometry(x_patches, self.mu, self.sigma(), self.ell, *self._steering(), steer=self.steer,
                                   radius=self.radius)

    # -- forward ---------------------------------------------------------------------------------------------------

    def forward(
        self, x: Tensor, grid: tuple[int, int] | None = None, *, num_prefix_tokens: int | None = None
    ) -> Tensor:
        """Mix tokens. The dense matrix this applies is ``attention_matrix(x, grid)`` (diagnostics).

        Args:
            x: ``(B, P + Gh*Gw, D)``, prefix tokens first, patches in raster order.
            grid: ``(Gh, Gw)``, two ints, required.
            num_prefix_tokens: ``P``, when the caller knows it (models pass it): a token count other than
                ``P + Gh*Gw`` is then an error, never a reinterpretation of patches as prefix tokens. Without it, at
                most one prefix token (a class token) is taken; more must be given.
        """
        if x.ndim != 3:
            raise ValueError(
                f"SSoGAttention expects x of shape (B, P + Gh*Gw, D), got a {x.ndim}-D tensor {tuple(x.shape)}"
            )
        if x.shape[-1] != self.dim:
            raise ValueError(f"last dimension of x is {x.shape[-1]}, expected dim={self.dim}")
        if grid is None:
            raise ValueError("SSoGAttention needs the patch grid: call attn(x, grid=(Gh, Gw))")
        gh, gw, p = ops.check_grid(x.shape[1], grid, num_prefix_tokens, max_implicit_prefix=1)
        if p and self.prefix_pool == "none":
            raise ValueError(f"got {p} prefix tokens but prefix_pool='none'; use prefix_pool='mean'")
        values = self.v(x)  # (B, P + N, D); the prefix rows of the output are the mean of the patch rows
        # Without autograd the values are this call's own buffer, so the mixing writes over them (one activation
        # less at the peak); not when traced, exported or compiled (the compiler plans the buffers itself).
        training = torch.is_grad_enabled() and values.requires_grad
        inplace = not training and not core.functional_only() and not torch.compiler.is_compiling()
        if self.steer:
            chunk = self.head_chunk
            if chunk is None and not core.functional_only():  # traced or exported, the mixing is the einsum path,
                chunk = default_head_chunk(  # which has no chunks; the sizing would guard a dynamic grid's range
                    (gh, gw), self.num_heads, self.num_atoms, self.dim, batch=x.shape[0], training=training,
                    itemsize=values.element_size(),
                )
            mixed = ops.ssog_mix_steered_by_tokens(
                values, (gh, gw), x, self.mu, self.sigma(), self.ell, self.tau(), *self._steering(),
                steer=self.steer, radius=self.radius, impl=self.impl, head_chunk=chunk, inplace=inplace,
            )
        elif self._tables_cached():
            ky, kx, lam, bands = self._fixed_kernels((gh, gw), values.dtype, bands=True)
            mixed = ops.ssog_mix(
                values, (gh, gw), ky, kx, lam, impl=self.impl, head_chunk=self.head_chunk, inplace=inplace,
                bands=bands,
            )
        else:  # training, tracing, compiling: the tables are built from the field inside the mixing
            mixed = ops.ssog_mix_field(values, (gh, gw), self.mu, self.sigma(), self.mixture(), self.tau(),
                                       impl=self.impl, head_chunk=self.head_chunk, inplace=inplace)
        del values  # in inference the values are freed before the output projection allocates its result
        return self.proj_drop(self.proj(mixed))

    def attention_matrix(self, x: Tensor, grid: tuple[int, int], *, num_prefix_tokens: int | None = None) -> Tensor:
        """The dense mixing matrix ``(B, H, T, T)`` this mixer applies to ``x`` (built by ``ssogvit.reference``);
        ``grid`` and ``num_prefix_tokens`` as in ``forward``."""
        gh, gw, p = ops.check_grid(x.shape[1], grid, num_prefix_tokens, max_implicit_prefix=1)
        b = x.shape[0]
        if self.steer:
            mu, sigma, lam = self.geometry(x[:, p:])
            a = reference.dense_steered_matrix(mu, sigma, lam, self.tau().to(mu.dtype), (gh, gw))
        else:
            a = reference.dense_fixed_matrix(self.mu, self.sigma(), self.mixture(), self.tau(), (gh, gw))
            a = a.unsqueeze(0).expand(b, -1, -1, -1)
        return reference.with_prefix(a, p).to(x.dtype)

    def extra_repr(self) -> str:
        steer = ",".join(self.steer) or "none"
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, num_atoms={self.num_atoms}, steer={steer}, "
            f"radius={self.radius}, sigma_min={self.sigma_min}, tau_min={self.tau_min}, impl={self.impl}"
        )

    # -- what the rest of the package asks of an SSoG mixer --------------------------------------------------------

    def no_weight_decay(self) -> set[str]:
        """Names (within this module, timm's convention) of the parameters that must not decay: the Gaussian field
        ``mu, rho, ell, theta`` and the steering gates ``alpha_*``."""
        return {"mu", "rho", "ell", "theta", *(f"alpha_{p}" for p in self.steer)}

    def field_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that shape the field: ``mu, rho, ell, theta`` and, steered, the steering maps and gates
        (everything but the value and output projections), by name."""
        return {n: p for n, p in self.named_parameters() if not n.startswith(("v.", "proj."))}

    def rho_for(self, sigma: Tensor) -> Tensor:
        """The raw widths ``rho`` that give the widths ``sigma``: the inverse of ``ops.field_sigma``.

        A width at or below the floor ``sigma_min + eps_sigma`` cannot be represented and lands just above it.
        """
        excess = (sigma - (self.sigma_min + self.eps_sigma)).clamp_min(torch.finfo(sigma.dtype).eps)
        return excess + torch.log(-torch.expm1(-excess))  # softplus^{-1}(y) = log(exp(y) - 1), stable for large y

    @checked
    def rescale_field(self, factor_y: Annotated[float, GRID_RATIO], factor_x: Annotated[float, GRID_RATIO]) -> None:
        """Scale the field in place by a grid ratio (docs/models.md, patch-size transfer): ``mu`` and ``sigma`` per
        axis (``sigma`` through ``rho``, see ``rho_for``), the steering radius by the geometric mean of the factors.
        The new field is checked first (``rescaled_field``): a refusal changes nothing."""
        rho, mu, radius = self.rescaled_field(factor_y, factor_x)
        with torch.no_grad():
            self.rho.copy_(rho)
            self.mu.copy_(mu)
        self.radius = radius

    @checked
    def rescaled_field(self, factor_y: Annotated[float, GRID_RATIO], factor_x: Annotated[float, GRID_RATIO]
                       ) -> tuple[Tensor, Tensor, float]:
        """``(rho, mu, radius)`` that ``rescale_field`` would set, nothing changed; an ``InputError`` where they are
        not finite in the parameters' dtype (a ratio of 1e39 is a finite float that float32 centres cannot hold)."""
        factor = torch.tensor([factor_y, factor_x], dtype=self.mu.dtype, device=self.mu.device)
        with torch.no_grad():
            rho, mu = self.rho_for(self.sigma() * factor), self.mu * factor
        radius = self.radius * math.sqrt(factor_y * factor_x)
        if not (bool(torch.isfinite(rho).all()) and bool(torch.isfinite(mu).all()) and math.isfinite(radius)):
            raise InputError(f"grid ratios ({factor_y}, {factor_x}) leave the field non-finite in {self.mu.dtype} "
                             "(its centres, widths or steering radius overflow): expected ratios that keep it finite",
                             argument="factor", expected="grid ratios that keep the field finite")
        return rho, mu, radius


def is_ssog(module: nn.Module) -> bool:
    """Whether ``module`` is an SSoG mixer (``SSoGAttention`` or a subclass such as ``TimmSSoGAttention``)."""
    return isinstance(module, SSoGAttention)
