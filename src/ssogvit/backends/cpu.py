"""SSoG on the CPU by a small C kernel (docs/operator.md, "Backends"): the whole mixing where no autograd runs through
it (inference, a training step's forward; fixed and steered), the steered backward (without a second derivative),
and the kernel tables where the torch path's matmuls need them (layouts the mixing cannot read).

Built with PyTorch operations, each table entry takes five passes (subtract, square, scale, softmax, flush) and costs
more than the 64 multiply-adds it then feeds, and a ViT-B layer at 224 px issues a dozen calls per head;
``_cpu_steered.c`` builds a row of queries' kernel rows in cache with a vectorised ``exp`` and mixes one (image, head)
at a time, both passes in register tiles, in one call per layer. It is compiled on first use with the system's C
compiler (``$CC``, else ``cc``; about a quarter of a second), cached under ``$SSOGVIT_CACHE`` (default
``~/.cache/ssogvit``) by a hash of its source, flags and compiler, and loaded with ``ctypes``; the work is split between
OpenMP threads (PyTorch's own libgomp, so ``torch.set_num_threads`` applies). The first use in a process also checks
its tables against the torch path and its mixing against the dense reference on small problems. Where there is no
compiler, or the build or that check fails, one ``RuntimeWarning`` says so and the torch path is used: slower, the
same result. ``SSOGVIT_CPU_KERNEL=0`` turns it off. Float32 and float64 CPU tensors only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from .. import reference as dense
from ._common import flush_tiny_product, grid_offsets

__all__ = ["ENV_SWITCH", "available", "enabled", "fixed_mix", "mixes", "steered_mix", "steered_mix_grad", "steered_rows"]

#: Environment variable: ``0`` keeps the steered tables on the torch path.
ENV_SWITCH = "SSOGVIT_CPU_KERNEL"
_SOURCE = Path(__file__).with_name("_cpu_steered.c")
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_switch: list[bool] = []  # set by ``enabled``


@contextmanager
def enabled(flag: bool):
    """Use the C kernel (``True``) or the torch path (``False``) inside the block, whatever ``SSOGVIT_CPU_KERNEL``
    says (tests compare the two)."""
    _switch.append(bool(flag))
    try:
        yield
    finally:
        _switch.pop()


def _wanted() -> bool:
    return _switch[-1] if _switch else os.environ.get(ENV_SWITCH, "1") != "0"


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    isa = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512dq", "-mfma"]}.get(capability, [])
    # -ffast-math lets gcc call glibc's vector exp; it is given when compiling only: linking a shared library with it
    # would add crtfastmath.o, which switches the whole process to flushing denormals. -fopenmp links libgomp.so.1,
    # which the loader resolves to the copy PyTorch has already loaded: one thread pool, sized by torch.
    return ["-O3", "-ffast-math", "-fPIC", "-fopenmp", *isa]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` (with one warning) when it cannot be built or loaded."""
    try:
        return _build_or_load()
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        warnings.warn(f"ssogvit: the CPU kernel for steered SSoG's tables is not available ({err}); using the torch "
                      f"path, which gives the same result more slowly", RuntimeWarning, stacklevel=3)
        return None


def _build_or_load() -> ctypes.CDLL:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError(f"no C compiler found ({os.environ.get('CC', 'cc')!r}; set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_flags()).encode(), version.encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("SSOGVIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                 / "ssogvit")
    lib = cache / f"cpu_steered-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            obj, out = Path(tmp) / "rows.o", Path(tmp) / "rows.so"
            for cmd in ([cc, *_flags(), "-c", str(_SOURCE), "-o", str(obj)],
                        [cc, "-shared", "-fopenmp", str(obj), "-o", str(out), "-lm"]):
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
            os.replace(out, lib)  # atomic: another process sees the old state or the whole library
    handle = ctypes.CDLL(str(lib))
    for suffix in _SUFFIX.values():
        rows, mix = getattr(handle, f"ssog_rows_{suffix}"), getattr(handle, f"ssog_mix_{suffix}")
        rows.argtypes, rows.restype = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5, None
        mix.argtypes, mix.restype = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 12, None
        grad = getattr(handle, f"ssog_mix_grad_{suffix}")
        grad.argtypes, grad.restype = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 14, None
    for name in ("ssog_mix_work", "ssog_mix_grad_work"):
        getattr(handle, name).argtypes, getattr(handle, name).restype = [ctypes.c_int64] * 4, ctypes.c_int64
    return handle


@functools.cache
def _checked(reference: Callable[..., Tensor]) -> bool:
    """The kernel against the torch path (``reference`` is ``ssogvit.ops.gaussian_rows``) and the dense reference on
    small problems with centres inside and outside the grid and narrow and wide kernels, in both dtypes: one warning
    and ``False`` if they differ. It runs wherever the first use happens, so it sets the modes it needs itself:
    autograd on (not under ``torch.inference_mode``), autocast off (the reference's float32 matmuls must stay
    float32), and saved-tensor hooks of its own (the first use can be inside a gradient-checkpointed block, whose
    hooks would take the check's tensors for the block's)."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return _agrees(reference)


def _agrees(reference: Callable[..., Tensor]) -> bool:
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        mu = (torch.rand(3, 2, 5, 3, 1, generator=g, dtype=dtype) - 0.5) * 16
        s = torch.rand(3, 2, 5, 3, 1, generator=g, dtype=dtype) * 4 + 0.05
        lam = torch.rand(3, 2, 5, 3, 1, generator=g, dtype=dtype)
        want = reference(grid_offsets(5, dtype, mu.device)[:, None, :], mu, s, inplace=True)
        got, weighted = _run(mu, s, None), _run(mu, s, lam)
        wanted_w = flush_tiny_product(want * lam)
        if not (torch.allclose(got, want, rtol=tol, atol=tol) and torch.allclose(weighted, wanted_w, rtol=tol,
                                                                                      atol=tol)):
            err = float((got - want).abs().max())
            warnings.warn(f"ssogvit: the CPU kernel for steered SSoG's tables disagrees with the torch path "
                          f"(max difference {err:.3g} in {dtype}); using the torch path", RuntimeWarning,
                          stacklevel=5)
            return False
        if not (_mix_agrees(dtype, tol, g) and _grad_agrees(dtype, tol, g)):
            return False
    return True


def _mix_agrees(dtype: torch.dtype, tol: float, g: torch.Generator) -> bool:
    """The kernel's mixing, steered and fixed, against the dense reference (one prefix token, whose row the kernel
    leaves alone; tau = 1/2 makes the reference's scale 1 / sigma)."""
    heads, gh, gw, r, dh = 2, 3, 5, 3, 3
    values = torch.randn(2, 1 + gh * gw, heads * dh, generator=g, dtype=dtype)
    mu = (torch.rand(2, gh * gw, heads, r, 2, generator=g, dtype=dtype) - 0.5) * 16
    s = torch.rand(2, gh * gw, heads, r, 2, generator=g, dtype=dtype) * 4 + 0.05
    lam = torch.rand(2, gh * gw, heads, r, generator=g, dtype=dtype)
    half = torch.tensor(0.5, dtype=dtype)
    cases = [(dense.dense_steered_matrix(mu, 1 / s, lam, half, (gh, gw)), {"steered": (mu, s, lam)})]
    ky, kx = (dense.dense_axis_kernel(n, mu[0, 0, ..., i], 1 / s[0, 0, ..., i], half) for i, n in enumerate((gh, gw)))
    fixed = dense.dense_fixed_matrix(mu[0, 0], 1 / s[0, 0], lam[0, 0], half, (gh, gw))
    cases.append((fixed.expand(2, -1, -1, -1), {"fixed": (ky, _weighted_rows(kx, lam[0, 0]))}))
    for a, operands in cases:
        want = dense.dense_mix(dense.with_prefix(a, 1), values)[:, 1:]
        got = values.clone()
        _mix(got, values, (gh, gw), heads, r, **operands)
        if not (torch.allclose(got[:, 1:], want, rtol=tol, atol=tol) and torch.equal(got[:, 0], values[:, 0])):
            warnings.warn(f"ssogvit: the CPU kernel for SSoG's mixing ({next(iter(operands))}) disagrees with the "
                          f"dense reference (max difference {float((got[:, 1:] - want).abs().max()):.3g} in {dtype}); "
                          f"using the torch path", RuntimeWarning, stacklevel=6)
            return False
    return True


def _grad_agrees(dtype: torch.dtype, tol: float, g: torch.Generator) -> bool:
    """The kernel's steered backward against autograd through the dense reference (as ``_mix_agrees``)."""
    heads, gh, gw, r, dh = 2, 4, 3, 3, 3
    values = torch.randn(2, 1 + gh * gw, heads * dh, generator=g, dtype=dtype)
    mu = (torch.rand(2, gh * gw, heads, r, 2, generator=g, dtype=dtype) - 0.5) * 6
    s = torch.rand(2, gh * gw, heads, r, 2, generator=g, dtype=dtype) * 2 + 0.2
    lam = torch.rand(2, gh * gw, heads, r, generator=g, dtype=dtype)
    grad = torch.randn(2, 1 + gh * gw, heads * dh, generator=g, dtype=dtype)
    grad[:, 0] = 0  # the prefix row's gradient is the caller's (backends._common.add_prefix_grad)
    inputs = [t.clone().requires_grad_() for t in (values, mu, s, lam)]
    with torch.enable_grad():
        a = dense.dense_steered_matrix(inputs[1], 1 / inputs[2], inputs[3], torch.tensor(0.5, dtype=dtype), (gh, gw))
        want = torch.autograd.grad((dense.dense_mix(dense.with_prefix(a, 1), inputs[0]) * grad).sum(), inputs)
    got = _mix_grad(values, grad, (gh, gw), mu, s, lam)
    got = (got[0], *got[1])
    worst = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(got, want))
    if worst < tol:
        return True
    warnings.warn(f"ssogvit: the CPU kernel for steered SSoG's backward disagrees with autograd through the dense "
                  f"reference (max relative difference {worst:.3g} in {dtype}); using the torch path",
                  RuntimeWarning, stacklevel=6)
    return False


def available(reference: Callable[..., Tensor]) -> bool:
    """Whether ``steered_rows`` will use the kernel (wanted, built, and checked against ``reference``)."""
    return _wanted() and _library() is not None and _checked(reference)


def steered_rows(mu: Tensor, scale: Tensor, lam: Tensor | None, reference: Callable[..., Tensor]) -> Tensor | None:
    """Kernel rows of a steered head chunk, ``(..., C, Q, R, Q)``, from per-token ``mu``, ``scale`` (and mixture
    weights ``lam``, multiplied in and flushed again) shaped ``(..., C, Q, R, 1)`` with the query index ``q`` on
    the axis of size ``Q``; ``None`` where the kernel does not apply (not a CPU float32/float64 tensor, autograd on
    them, a layout it cannot read, under ``torch.compile``, or the kernel unavailable): the caller then takes the
    torch path."""
    if torch.compiler.is_compiling():  # torch.compile builds the tables itself; a ctypes call would break its graph
        return None
    args = [t for t in (mu, scale, lam) if t is not None]
    if (mu.device.type != "cpu" or mu.dtype not in _SUFFIX or any(t.dtype != mu.dtype or t.shape != mu.shape
                                                                   for t in args)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in args)) or not available(reference)):
        return None
    return _run(mu, scale, lam)


def _run(mu: Tensor, scale: Tensor, lam: Tensor | None) -> Tensor | None:
    layouts = {_layout(t) for t in (mu, scale, lam) if t is not None}
    if len(layouts) != 1 or None in layouts:
        return None
    ((m, stride),) = layouts
    *outer, c, q, r, _ = mu.shape
    out = torch.empty(*outer, c, q, r, q, dtype=mu.dtype)
    fn = getattr(_library(), f"ssog_rows_{_SUFFIX[mu.dtype]}")
    fn(mu.data_ptr(), scale.data_ptr(), lam.data_ptr() if lam is not None else None, out.data_ptr(), stride, m, c, q, r)
    return out


def _layout(t: Tensor) -> tuple[int, int] | None:
    """``(M, stride)`` when ``t`` ``(..., C, Q, R, 1)`` is ``M`` contiguous ``(C, Q, R)`` blocks ``stride`` elements
    apart (a contiguous tensor, or a head slice of one), else ``None``."""
    if t.ndim < 4 or t.shape[-1] != 1:
        return None
    c, q, r = t.shape[-4:-1]
    for size, stride, want in zip((c, q, r), t.stride()[-4:-1], (q * r, r, 1)):
        if size > 1 and stride != want:
            return None
    m, step, expected = 1, c * q * r, None
    for size, stride in zip(reversed(t.shape[:-4]), reversed(t.stride()[:-4])):
        if size == 1:
            continue
        if expected is None:
            step = expected = stride
        if stride != expected:
            return None
        m, expected = m * size, expected * size
    return m, step


def mixes(values: Tensor, operands: tuple[Tensor, ...], reference: Callable[..., Tensor],
          out: Tensor | None = None) -> bool:
    """Whether the mixing kernel applies to ``values`` and its ``operands`` (and ``out``, when it is another
    tensor): CPU float32/float64 tensors of one dtype, rows of unit stride, no autograd through them, not under
    ``torch.compile``, the kernel available (``available(reference)``)."""
    if torch.compiler.is_compiling():  # a ctypes call would break the compiler's graph
        return False
    out = values if out is None else out
    return not (values.device.type != "cpu" or values.dtype not in _SUFFIX
                or any(t.dtype != values.dtype or t.device != values.device for t in (out, *operands))
                or values.stride(-1) != 1 or out.stride(-1) != 1
                or (torch.is_grad_enabled() and any(t.requires_grad for t in (values, out, *operands)))
                or not available(reference))


def steered_mix(out: Tensor, values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor,
                reference: Callable[..., Tensor]) -> bool:
    """Write the steered mixing of the patch tokens of ``values`` ``(B, P + N, D)`` into ``out`` (the same shape; it
    may be ``values`` itself) from per-token ``mu``, ``scale`` ``(B, N, H, R, 2)`` (scale broadcastable to it) and
    ``lam`` ``(B, N, H, R)``, and return ``True``; the prefix rows of ``out`` are left alone. ``False`` (nothing
    written) where the kernel does not apply (``mixes``): the caller then takes the torch path."""
    if not mixes(values, (mu, scale, lam), reference, out):
        return False
    geo = (mu.contiguous(), scale.expand(mu.shape).contiguous(), lam.contiguous())
    _mix(out, values, grid, mu.shape[2], mu.shape[3], steered=geo)
    return True


def fixed_mix(out: Tensor, values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor) -> None:
    """``steered_mix`` for the fixed field, where ``mixes(values, (ky, kx, lam), ...)`` said it applies: kernels
    ``ky (H, R, Gh, Gh)``, ``kx (H, R, Gw, Gw)`` and weights ``lam (H, R)`` (``ssogvit.ops.ssog_mix``'s arguments)."""
    _mix(out, values, grid, *lam.shape, fixed=(ky.contiguous(), _weighted_rows(kx, lam)))


def _weighted_rows(kx: Tensor, lam: Tensor) -> Tensor:
    """The fixed row pass's matrix ``lambda K^x``, flushed (docs/operator.md, "Denormals"), laid out
    ``(H, Gw, R, Gw)``: the rows of query ``ix`` for all atoms together."""
    return flush_tiny_product(kx * lam[:, :, None, None]).transpose(1, 2).contiguous()


def _mix(out: Tensor, values: Tensor, grid: tuple[int, int], heads: int, r: int, *,
         steered: tuple[Tensor, Tensor, Tensor] | None = None, fixed: tuple[Tensor, Tensor] | None = None) -> None:
    (b, t, d), (gh, gw) = values.shape, grid
    lib = _library()
    threads = max(1, min(torch.get_num_threads(), b * heads))
    # each thread's scratch (one head's values and result, a row's tables) from PyTorch, so its allocator counts it
    work = torch.empty(threads * lib.ssog_mix_work(gh, gw, r, d // heads), dtype=values.dtype)
    pointers = [x.data_ptr() if x is not None else None for x in (*(steered or (None,) * 3), *(fixed or (None,) * 2))]
    getattr(lib, f"ssog_mix_{_SUFFIX[values.dtype]}")(
        values.data_ptr(), out.data_ptr(), *pointers, work.data_ptr(), threads, b, values.stride(0), values.stride(1),
        out.stride(0), out.stride(1), t - gh * gw, gh, gw, heads, r, d // heads)


def steered_mix_grad(values: Tensor, grad: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor,
                     reference: Callable[..., Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]] | None:
    """Gradients of the steered mixing of ``values`` (arguments as in ``steered_mix``) given ``grad = dL/dout``: for
    the values (the patch rows' part; the prefix rows' contribution, ``backends._common.add_prefix_grad``, is the
    caller's) and for ``mu``, ``scale`` (reduced to its shape) and ``lam``; ``None`` where the kernel does not apply
    (``mixes``)."""
    if not mixes(values, (grad, mu, scale, lam), reference) or grad.stride(-1) != 1:
        return None
    g_values, (g_mu, g_scale, g_lam) = _mix_grad(
        values, grad, grid, mu.contiguous(), scale.expand(mu.shape).contiguous(), lam.contiguous())
    return g_values, (g_mu, g_scale.sum_to_size(scale.shape), g_lam)


def _mix_grad(values: Tensor, grad: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor
              ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    (b, t, d), (gh, gw), (heads, r) = values.shape, grid, mu.shape[2:4]
    lib = _library()
    threads = max(1, min(torch.get_num_threads(), b * heads))
    work = torch.empty(threads * lib.ssog_mix_grad_work(gh, gw, r, d // heads), dtype=values.dtype)
    g_values = torch.zeros_like(values)
    g_mu, g_scale, g_lam = torch.empty_like(mu), torch.empty_like(scale), torch.empty_like(lam)
    getattr(lib, f"ssog_mix_grad_{_SUFFIX[values.dtype]}")(
        *(x.data_ptr() for x in (values, grad, g_values, mu, scale, lam, g_mu, g_scale, g_lam, work)), threads, b,
        values.stride(0), values.stride(1), grad.stride(0), grad.stride(1), g_values.stride(0), g_values.stride(1),
        t - gh * gw, gh, gw, heads, r, d // heads)
    return g_values, (g_mu, g_scale, g_lam)
