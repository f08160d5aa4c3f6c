"""The C backend (``impl="cpu"``): SSoG's fixed and steered mixing, forward and backward, by a small C kernel
registered as PyTorch ops (docs/operator.md, "Backends").

Built with PyTorch operations, each steered table entry takes five passes (subtract, square, scale, softmax, flush)
and costs more than the 64 multiply-adds it then feeds, and a ViT-B layer at 224 px issues a dozen calls per head;
``_cpu_kernels.c`` builds a row of queries' kernel rows in cache with a vectorised ``exp`` and mixes one (image,
head) at a time, both passes in register tiles, in one call per layer. It is compiled on first use with the system's
C compiler (``$CC``, else ``cc``; about a quarter of a second), cached under ``$SSOGVIT_CACHE`` (default
``~/.cache/ssogvit``) by a hash of its source, flags and compiler, and loaded with ``ctypes``; the work is split
between OpenMP threads (PyTorch's own libgomp, so ``torch.set_num_threads`` applies). The first use in a process also
checks its mixing and its backwards against the dense reference on small problems. Where there is no compiler, or
the build or that check fails, one ``RuntimeWarning`` says so and ``impl="auto"`` takes the torch backend: slower,
the same result. ``SSOGVIT_CPU_KERNEL=0`` turns it off. Float32 and float64 CPU tensors only.

The entry points are ops of the ``ssogvit`` namespace (``torch.ops.ssogvit.cpu_fixed_mix`` and the rest, each with a
fake implementation), so ``torch.compile`` keeps them in its graph. The mixings' autograd is ``ssogvit.ops``'s, wired
once for every backend; the two field ops that only this backend has, ``cpu_axis_kernels`` and ``cpu_field_mix``,
carry their own (docs/operator.md, "Backends").
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
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from ssogvit import core
from ssogvit import reference as dense

from ._common import add_prefix_grad, graph_grads, write_prefix_pool

__all__ = ["ENV_SWITCH", "available", "axis_kernels", "enabled", "field_mix", "fixed_backward", "fixed_forward",
           "steered_backward", "steered_forward", "unsupported"]

#: Environment variable: ``0`` keeps SSoG off the C kernel.
ENV_SWITCH = "SSOGVIT_CPU_KERNEL"
_SOURCE = Path(__file__).with_name("_cpu_kernels.c")
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_switch: list[bool] = []  # set by ``enabled``


@contextmanager
def enabled(flag: bool):
    """Let ``impl="auto"`` use the C kernel (``True``) or not (``False``) inside the block, whatever
    ``SSOGVIT_CPU_KERNEL`` says (tests compare the two). Code compiled by ``torch.compile`` keeps the choice it was
    compiled with."""
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
    # -ffast-math lets gcc call glibc's vector exp; -fno-finite-math-only keeps NaN and infinities IEEE (comparisons
    # with a NaN false, 0 * inf a NaN), as in the torch path. Both are given when compiling only: linking a shared
    # library with -ffast-math would add crtfastmath.o, which switches the whole process to flushing denormals.
    # -fopenmp links libgomp.so.1, which the loader resolves to the copy PyTorch has already loaded: one thread pool.
    return ["-O3", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-fopenmp", *isa]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` (with one warning) when it cannot be built or loaded."""
    try:
        return _build_or_load()
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        warnings.warn(f"ssogvit: the CPU kernel for SSoG is not available ({err}); using the torch path, which gives "
                      f"the same result more slowly", RuntimeWarning, stacklevel=3)
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
    lib = cache / f"cpu_kernels-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            obj, out = Path(tmp) / "kernels.o", Path(tmp) / "kernels.so"
            for cmd in ([cc, *_flags(), "-c", str(_SOURCE), "-o", str(obj)],
                        [cc, "-shared", "-fopenmp", str(obj), "-o", str(out), "-lm"]):
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
            os.replace(out, lib)  # atomic: another process sees the old state or the whole library
    handle = ctypes.CDLL(str(lib))
    # name: (pointer arguments, integer arguments, arguments of its scratch size, or None: no scratch)
    signatures = {"ssog_mix": (10, 12, 4), "ssog_mix_grad": (11, 14, 4), "ssog_fixed_grad": (10, 14, 4),
                  "ssog_axis_kernels": (4, 2, 1), "ssog_axis_kernels_grad": (6, 2, None)}
    for name, (pointers, ints, work_ints) in signatures.items():
        for suffix in _SUFFIX.values():
            fn = getattr(handle, f"{name}_{suffix}")
            fn.argtypes, fn.restype = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * ints, None
        if work_ints:
            work = getattr(handle, f"{name}_work")
            work.argtypes, work.restype = [ctypes.c_int64] * work_ints, ctypes.c_int64
    return handle


@torch.compiler.assume_constant_result
def available(dtype: torch.dtype | None = None) -> bool:
    """Whether the C kernel can be used: wanted (``enabled``, ``SSOGVIT_CPU_KERNEL``), built, and checked against the
    dense reference in this process, in ``dtype`` (each dtype's check on its first use: a float32 model's process
    never pays float64's) or, without one, in every dtype it mixes. ``torch.compile`` takes the answer as a constant
    of its graph."""
    return _wanted() and _library() is not None and all(_checked(d) for d in ((dtype,) if dtype else _TOLERANCE))


def unsupported(kind: str, values: Tensor, *operands: Tensor, auto: bool) -> str | None:
    """The probe of ``ssogvit.ops``: why the kernel cannot mix ``values`` with ``operands`` (``None``: it can), for
    every ``kind`` (``ops.backend_for``'s) alike."""
    if values.device.type != "cpu" or values.dtype not in _SUFFIX:
        return f"the C kernel mixes float32 and float64 CPU tensors, got {values.dtype} on {values.device}"
    if any(t.dtype != values.dtype or t.device != values.device for t in operands):
        return "the C kernel needs the values and the field in one dtype on one device"
    if not available(values.dtype):
        return (f"the C kernel is turned off ({ENV_SWITCH}=0 or cpu.enabled(False))" if not _wanted() else
                "the C kernel could not be built or failed its check (see the warning)")
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The calls into the library


def _threads(units: int) -> int:
    return max(1, min(torch.get_num_threads(), units))


def _work(name: str, threads: int, *sizes: int, dtype: torch.dtype) -> Tensor:
    """Each thread's scratch, from PyTorch's allocator (so that memory benchmarks count it)."""
    return torch.empty(threads * getattr(_library(), f"{name}_work")(*sizes), dtype=dtype)


def _rows(t: Tensor) -> Tensor:
    """``t`` with unit stride along its last axis, as the kernel reads rows."""
    return t if t.stride(-1) == 1 else t.contiguous()


#: The banded mixing is taken where the bands' mean length is at most this fraction of their rows' length
#: (docs/operator.md, "Bands"; the measurement: docs/benchmarks.md, "Banded mixing").
BAND_FRACTION = 0.5


def banded(band: Tensor, length: int | Tensor) -> bool:
    """Whether bands ``(..., 2)`` (``core.axis_band``) of rows of ``length`` entries make the banded mixing faster
    than the dense one: their mean length at most ``BAND_FRACTION`` of the row's."""
    return bool(((band[..., 1] - band[..., 0]) / length).mean() <= BAND_FRACTION)


def may_band(scale: Tensor, grid: tuple[int, int], dtype: torch.dtype) -> bool:
    """``banded`` asked before the bands are built, of their interior length ``2 floor(w) + 1`` (at most the row;
    ``w = core.band_halfwidth``), which no row's band exceeds: a field whose bands cannot pay costs no more than a
    few numbers per atom (``scale`` ``(..., 2)``, axis order ``(y, x)``)."""
    lengths = torch.tensor(grid, dtype=torch.float64)
    interior = (2 * core.band_halfwidth(scale, dtype).floor() + 1).minimum(lengths)
    return bool((interior / lengths).mean() <= BAND_FRACTION)


def _narrow(bands: tuple[Tensor, ...] | None, *lengths: int | Tensor) -> tuple[Tensor, ...] | None:
    """``bands`` where all of them are narrow enough to pay (``banded``), else ``None`` (the dense mixing)."""
    return bands if bands is not None and all(banded(b, n) for b, n in zip(bands, lengths)) else None


def field_bands(mu: Tensor, scale: Tensor, grid: tuple[int, int], dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """The field's bands (``core.field_bands``, ``(H, R, 2)`` centres and scales) where they pay, else ``None``: what
    its op's forward and backward both read."""
    if not may_band(scale, grid, dtype):
        return None
    return _narrow(tuple(b.contiguous() for b in core.field_bands(mu, scale, grid, dtype)), *grid)


def _token_bands(mu: Tensor, scale: Tensor, grid: tuple[int, int], dtype: torch.dtype) -> Tensor | None:
    """The steered geometry's bands (``core.token_bands``, one contiguous ``(B, N, H, R, 2, 2)`` array) where they
    pay, else ``None``: what the steered op's forward and backward both read."""
    if not may_band(scale, grid, dtype):
        return None
    band = _narrow((core.token_bands(mu, scale, grid, dtype),), torch.tensor(grid))
    return band and band[0].contiguous()


def _finite(*tensors: Tensor) -> bool:
    """Whether the field or geometry is finite: a backward reads the bands only then, so that a NaN or an infinity
    of a kernel row reaches every gradient the dense backward takes it to (docs/operator.md, "Bands")."""
    return all(bool(t.isfinite().all()) for t in tensors)


def _mix_into(out: Tensor, values: Tensor, grid: tuple[int, int], heads: int, atoms: int, *,
              steered: tuple[Tensor, Tensor, Tensor] | None = None, fixed: tuple[Tensor, Tensor] | None = None,
              bands: tuple[Tensor, Tensor] | None = None) -> None:
    """``ssog_mix_*``: the patch rows of ``out`` (which may be ``values``), prefix rows first; ``bands`` the rows'
    (``fixed_bands``: two arrays; ``steered_bands``: one, given as its y and x halves), ``None`` all of each row."""
    (b, t, d), (gh, gw) = values.shape, grid
    write_prefix_pool(out, values, t - gh * gw)
    threads = _threads(b * heads)
    work = _work("ssog_mix", threads, gh, gw, atoms, d // heads, dtype=values.dtype)
    pointers = [x.data_ptr() if x is not None else None for x in (*(steered or (None,) * 3), *(fixed or (None,) * 2),
                                                                  *(bands or (None,) * 2))]
    getattr(_library(), f"ssog_mix_{_SUFFIX[values.dtype]}")(
        values.data_ptr(), out.data_ptr(), *pointers, work.data_ptr(), threads, b, values.stride(0), values.stride(1),
        out.stride(0), out.stride(1), t - gh * gw, gh, gw, heads, atoms, d // heads)


def _fixed_tables(ky: Tensor, kx: Tensor, lam: Tensor) -> tuple[Tensor, Tensor]:
    """``(lam K^y (H, R, Gh, Gh), K^x (H, Gw, R, Gw))``: core.mix_fixed's factors, the product flushed, laid out as the
    kernel reads them (the row pass's rows of query ``ix`` for all atoms together)."""
    return (core.flush_tiny_product(ky * lam[:, :, None, None]).contiguous(), kx.transpose(1, 2).contiguous())


def _grid(ky: Tensor, kx: Tensor) -> tuple[int, int]:
    return ky.shape[-1], kx.shape[-1]


def _fixed_into(out: Tensor, values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor,
                bands: tuple[Tensor, Tensor] | None = None) -> None:
    grid = _grid(ky, kx)
    tables = _fixed_tables(ky, kx, lam)
    if any(torch.isinf(t).any() for t in tables):  # where two infinities of both signs meet depends on the order of
        out.copy_(core.mix_fixed(values, grid, ky, kx, lam))  # the passes: the torch backend's, the x-pass first
        return
    _mix_into(out, values, grid, *lam.shape, fixed=tables, bands=_narrow(bands, *grid))


def _pair(band_y: Tensor | None, band_x: Tensor | None) -> tuple[Tensor, Tensor] | None:
    return None if band_y is None or band_x is None else (band_y.contiguous(), band_x.contiguous())


@torch.library.custom_op("ssogvit::cpu_fixed_mix", mutates_args=(), device_types="cpu")
def _fixed_mix(values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor, band_y: Tensor | None = None,
               band_x: Tensor | None = None) -> Tensor:
    """``core.mix_fixed`` by the kernel: values ``(B, P + N, D)``, ky ``(H, R, Gh, Gh)``, kx ``(H, R, Gw, Gw)``,
    lam ``(H, R)``; the rows' bands ``band_y (H, R, Gh, 2)``, ``band_x (H, R, Gw, 2)`` (``core.field_bands``) if
    given, read where they pay (``banded``)."""
    values = _rows(values)
    out = values.new_empty(values.shape)
    _fixed_into(out, values, ky, kx, lam, _pair(band_y, band_x))
    return out


@torch.library.custom_op("ssogvit::cpu_fixed_mix_", mutates_args=("values",), device_types="cpu")
def _fixed_mix_(values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor, band_y: Tensor | None = None,
                band_x: Tensor | None = None) -> None:
    """``cpu_fixed_mix`` written over the values (inference: one activation-sized buffer less)."""
    if values.stride(-1) != 1:
        values.copy_(_fixed_mix(values, ky, kx, lam, band_y, band_x))
        return
    _fixed_into(values, values, ky, kx, lam, _pair(band_y, band_x))


@torch.library.custom_op("ssogvit::cpu_fixed_mix_backward", mutates_args=(), device_types="cpu")
def _fixed_mix_backward(grad: Tensor, values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``cpu_fixed_mix`` for ``values``, ``ky``, ``kx`` and ``lam`` given ``grad``."""
    return _fixed_grads(grad, values, ky, kx, lam)


def _fixed_grads(grad: Tensor, values: Tensor, ky: Tensor, kx: Tensor, lam: Tensor,
                 bands: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ssog_fixed_grad_*``: the gradients of the fixed mixing for the values, both tables and ``lam``; with
    ``bands`` (``field_bands``: the tables must be that field's) every product reads only the bands, and the
    tables' gradients are zero outside them (docs/operator.md, "Bands")."""
    grad, values = _rows(grad), _rows(values)
    (b, t, d), (h, r), (gh, gw) = values.shape, lam.shape, _grid(ky, kx)
    kyl = core.flush_tiny_product(ky * lam[:, :, None, None]).contiguous()
    threads = _threads(b * h)
    work = _work("ssog_fixed_grad", threads, gh, gw, r, d // h, dtype=values.dtype)
    g_values = values.new_zeros(values.shape)
    g_kyl, g_kx = values.new_zeros(b, h, r, gh, gh), values.new_zeros(b, h, r, gw, gw)  # per image, summed below
    band_y, band_x = bands or (None, None)
    getattr(_library(), f"ssog_fixed_grad_{_SUFFIX[values.dtype]}")(
        *(x.data_ptr() if x is not None else None for x in (values, grad, g_values, kyl, kx.contiguous(), band_y,
                                                             band_x, g_kyl, g_kx, work)), threads, b,
        values.stride(0), values.stride(1), grad.stride(0), grad.stride(1), g_values.stride(0), g_values.stride(1),
        t - gh * gw, gh, gw, h, r, d // h)
    add_prefix_grad(g_values, grad, t - gh * gw)
    g_kyl = g_kyl.sum(0)
    return g_values, g_kyl * lam[:, :, None, None], g_kx.sum(0), (g_kyl * ky).sum(dim=(-1, -2))


@torch.library.custom_op("ssogvit::cpu_steered_mix", mutates_args=(), device_types="cpu")
def _steered_mix(values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, gh: int, gw: int) -> Tensor:
    """``core.mix_steered`` by the kernel: values ``(B, P + N, D)``, mu and scale ``(B, N, H, R, 2)``, lam
    ``(B, N, H, R)``, the grid ``(gh, gw)``."""
    values = _rows(values)
    out = values.new_empty(values.shape)
    _steered_into(out, values, mu, scale, lam, (gh, gw))
    return out


def _steered_into(out: Tensor, values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, grid: tuple[int, int]) -> None:
    """The steered mixing into ``out``, banded where that pays (``_token_bands``)."""
    band = _token_bands(mu, scale, grid, values.dtype)
    _mix_into(out, values, grid, *mu.shape[2:4], steered=(mu.contiguous(), scale.contiguous(), lam.contiguous()),
              bands=None if band is None else (band[..., 0, :], band[..., 1, :]))


@torch.library.custom_op("ssogvit::cpu_steered_mix_", mutates_args=("values",), device_types="cpu")
def _steered_mix_(values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, gh: int, gw: int) -> None:
    """``cpu_steered_mix`` written over the values."""
    if values.stride(-1) != 1:
        values.copy_(_steered_mix(values, mu, scale, lam, gh, gw))
        return
    _steered_into(values, values, mu, scale, lam, (gh, gw))


@torch.library.custom_op("ssogvit::cpu_steered_mix_backward", mutates_args=(), device_types="cpu")
def _steered_mix_backward(grad: Tensor, values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, gh: int, gw: int
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``cpu_steered_mix`` for ``values``, ``mu``, ``scale`` and ``lam`` given ``grad``, reading the
    bands its forward reads where the geometry is finite (docs/operator.md, "Bands")."""
    band = _token_bands(mu, scale, (gh, gw), values.dtype) if _finite(mu, scale, lam) else None
    return _steered_grads(grad, values, mu, scale, lam, (gh, gw), band)


def _steered_grads(grad: Tensor, values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, grid: tuple[int, int],
                   band: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ssog_mix_grad_*``; ``band`` the geometry's (``_token_bands``) or ``None`` (every entry)."""
    grad, values, mu, scale, lam = _rows(grad), _rows(values), mu.contiguous(), scale.contiguous(), lam.contiguous()
    (b, t, d), (h, r), (gh, gw) = values.shape, mu.shape[2:4], grid
    threads = _threads(b * h)
    work = _work("ssog_mix_grad", threads, gh, gw, r, d // h, dtype=values.dtype)
    g_values = values.new_zeros(values.shape)
    g_mu, g_scale, g_lam = (t.new_empty(t.shape) for t in (mu, scale, lam))
    getattr(_library(), f"ssog_mix_grad_{_SUFFIX[values.dtype]}")(
        *(x.data_ptr() if x is not None else None for x in (values, grad, g_values, mu, scale, lam, band, g_mu,
                                                             g_scale, g_lam, work)), threads, b,
        values.stride(0), values.stride(1), grad.stride(0), grad.stride(1), g_values.stride(0), g_values.stride(1),
        t - gh * gw, gh, gw, h, r, d // h)
    add_prefix_grad(g_values, grad, t - gh * gw)
    return g_values, g_mu, g_scale, g_lam


@torch.library.custom_op("ssogvit::cpu_axis_kernels", mutates_args=(), device_types="cpu")
def _axis_kernels(mu: Tensor, scale: Tensor, length: int) -> Tensor:
    """``core.axis_rows`` by the kernel: centres and ``core.kernel_scale`` of one axis, any shape ``S`` (one
    dtype), to the kernels ``S + (length, length)``."""
    return _axis_rows(mu, scale, length)


def _axis_rows(mu: Tensor, scale: Tensor, length: int) -> Tensor:
    mu, scale = mu.contiguous(), scale.contiguous()
    out, work = mu.new_empty(*mu.shape, length, length), _work("ssog_axis_kernels", 1, length, dtype=mu.dtype)
    getattr(_library(), f"ssog_axis_kernels_{_SUFFIX[mu.dtype]}")(
        mu.data_ptr(), scale.data_ptr(), out.data_ptr(), work.data_ptr(), mu.numel(), length)
    return out


@torch.library.custom_op("ssogvit::cpu_axis_kernels_backward", mutates_args=(), device_types="cpu")
def _axis_kernels_backward(grad: Tensor, kernels: Tensor, mu: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of ``cpu_axis_kernels`` for ``mu`` and ``scale`` given ``grad`` (shaped as the kernels)."""
    return _axis_grads(grad, kernels, mu, scale)


def _axis_grads(grad: Tensor, kernels: Tensor, mu: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    grad, kernels, mu, scale = (t.contiguous() for t in (grad, kernels, mu, scale))
    g_mu, g_scale = mu.new_empty(mu.shape), scale.new_empty(scale.shape)
    getattr(_library(), f"ssog_axis_kernels_grad_{_SUFFIX[mu.dtype]}")(
        *(t.data_ptr() for t in (kernels, grad, mu, scale, g_mu, g_scale)), mu.numel(), kernels.shape[-1])
    return g_mu, g_scale


def _field_tables(mu: Tensor, scale: Tensor, gh: int, gw: int) -> tuple[Tensor, Tensor]:
    """The axis kernels ``(K^y, K^x)`` of a field, ``mu`` and ``scale`` ``(H, R, 2)`` (axis order ``(y, x)``)."""
    return _axis_rows(mu[..., 0], scale[..., 0], gh), _axis_rows(mu[..., 1], scale[..., 1], gw)


@torch.library.custom_op("ssogvit::cpu_field_mix", mutates_args=(), device_types="cpu")
def _field_mix(values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, gh: int, gw: int) -> Tensor:
    """``cpu_fixed_mix`` of the field's own tables: mu and scale ``(H, R, 2)``, lam ``(H, R)``, the grid
    ``(gh, gw)``. One op each way for what a training step would otherwise build and differentiate in a dozen."""
    values = _rows(values)
    out = values.new_empty(values.shape)
    _fixed_into(out, values, *_field_tables(mu, scale, gh, gw), lam, field_bands(mu, scale, (gh, gw), values.dtype))
    return out


@torch.library.custom_op("ssogvit::cpu_field_mix_backward", mutates_args=(), device_types="cpu")
def _field_mix_backward(grad: Tensor, values: Tensor, mu: Tensor, scale: Tensor, lam: Tensor, gh: int, gw: int
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``cpu_field_mix`` for ``values``, ``mu``, ``scale`` and ``lam`` given ``grad``: the tables
    rebuilt, the fixed mixing's backward (reading the bands the forward reads, where the field is finite; docs/
    operator.md, "Bands"), then the tables'."""
    ky, kx = _field_tables(mu, scale, gh, gw)
    bands = field_bands(mu, scale, (gh, gw), values.dtype) if _finite(mu, scale, lam) else None
    g_values, g_ky, g_kx, g_lam = _fixed_grads(grad, values, ky, kx, lam, bands)
    g_mu, g_scale = zip(*(_axis_grads(g, k, mu[..., i], scale[..., i]) for i, (g, k) in
                          enumerate(((g_ky, ky), (g_kx, kx)))))
    return g_values, torch.stack(g_mu, -1), torch.stack(g_scale, -1), g_lam


def _new(*tensors: Tensor) -> Tensor | tuple[Tensor, ...]:
    """Fresh contiguous tensors shaped as ``tensors``: what the ops return, for their fake implementations."""
    out = tuple(t.new_empty(t.shape) for t in tensors)
    return out[0] if len(out) == 1 else out


@_fixed_mix.register_fake
def _(values, ky, kx, lam, band_y=None, band_x=None):
    return _new(values)


@_fixed_mix_.register_fake
def _(values, ky, kx, lam, band_y=None, band_x=None):
    return None


@_fixed_mix_backward.register_fake
def _(grad, values, ky, kx, lam):
    return _new(values, ky, kx, lam)


@_steered_mix.register_fake
def _(values, mu, scale, lam, gh, gw):
    return _new(values)


@_axis_kernels.register_fake
def _(mu, scale, length):
    return mu.new_empty(*mu.shape, length, length)


@_axis_kernels_backward.register_fake
def _(grad, kernels, mu, scale):
    return _new(mu, scale)


@_field_mix.register_fake
def _(values, mu, scale, lam, gh, gw):
    return _new(values)


@_field_mix_backward.register_fake
def _(grad, values, mu, scale, lam, gh, gw):
    return _new(values, mu, scale, lam)


@_steered_mix_.register_fake
def _(values, mu, scale, lam, gh, gw):
    return None


@_steered_mix_backward.register_fake
def _(grad, values, mu, scale, lam, gh, gw):
    return _new(values, mu, scale, lam)


# Autograd: the mixings' (cpu_fixed_mix, cpu_steered_mix) is wired once for every backend by ``ssogvit.ops``
# (``_FixedMix``, ``_SteeredMix``), which call the forward ops without autograd and their backward ops in its backward.
# The two field ops, which only this backend has (``ops.axis_kernels``, ``ops.ssog_mix_field`` call them with
# autograd), carry their own, here. One autograd per op.


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.grid = tuple(inputs[4:])


def _save_axis(ctx, inputs, output) -> None:
    ctx.save_for_backward(output, *inputs[:2])


def _axis_kernels_grad(ctx, grad: Tensor):
    kernels, mu, scale = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a backward autograd can differentiate again, by core's ops
        return *graph_grads(lambda m, s: core.axis_rows(kernels.shape[-1], m, s), (mu, scale), grad), None
    return *_axis_kernels_backward(grad, kernels, mu, scale), None


def _field_mix_grad(ctx, grad: Tensor):
    if torch.is_grad_enabled():  # create_graph=True, as above
        (gh, gw), saved = ctx.grid, ctx.saved_tensors
        mix = lambda v, m, s, lam: core.mix_fixed(v, (gh, gw), core.axis_rows(gh, m[..., 0], s[..., 0]),  # noqa: E731
                                                  core.axis_rows(gw, m[..., 1], s[..., 1]), lam)
        return *graph_grads(mix, saved, grad), None, None
    return *_field_mix_backward(grad, *ctx.saved_tensors, *ctx.grid), None, None


_axis_kernels.register_autograd(_axis_kernels_grad, setup_context=_save_axis)
_field_mix.register_autograd(_field_mix_grad, setup_context=_save_inputs)


# ---------------------------------------------------------------------------------------------------------------------
# The backend's entry points (``ssogvit.ops`` calls them without autograd and wires them into it)


def axis_kernels(length: int, mu: Tensor, scale: Tensor) -> Tensor:
    """``core.axis_kernels`` of the centres ``mu`` and ``core.kernel_scale`` ``scale`` (one shape and dtype), with
    autograd: one op each way where torch would issue a dozen small ones (a training step of the fixed field builds
    its tables anew)."""
    return torch.ops.ssogvit.cpu_axis_kernels(mu, scale, length)


def field_mix(values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor) -> Tensor:
    """``fixed_forward`` of the field's own tables (``mu``, ``scale`` ``(H, R, 2)``, ``lam`` ``(H, R)``), with
    autograd for all four."""
    return torch.ops.ssogvit.cpu_field_mix(values, mu, scale, lam, *grid)


def fixed_forward(values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor, *,
                  inplace: bool = False, head_chunk: int | None = None,
                  bands: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``core.mix_fixed`` (``head_chunk`` is the torch backend's and ignored here); ``inplace`` writes over the
    values and returns them; ``bands`` the tables' (``core.field_bands``), read where they pay."""
    bands = bands or (None, None)
    if inplace:
        torch.ops.ssogvit.cpu_fixed_mix_(values, ky, kx, lam, *bands)
        return values
    return torch.ops.ssogvit.cpu_fixed_mix(values, ky, kx, lam, *bands)


def fixed_backward(grad: Tensor, values: Tensor, grid: tuple[int, int], ky: Tensor, kx: Tensor, lam: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``fixed_forward`` for ``values``, ``ky``, ``kx`` and ``lam``."""
    return torch.ops.ssogvit.cpu_fixed_mix_backward(grad, values, ky, kx, lam)


def steered_forward(values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor, *,
                    inplace: bool = False, head_chunk: int | None = None) -> Tensor:
    """``core.mix_steered``; ``inplace`` writes over the values and returns them."""
    if inplace:
        torch.ops.ssogvit.cpu_steered_mix_(values, mu, scale, lam, *grid)
        return values
    return torch.ops.ssogvit.cpu_steered_mix(values, mu, scale, lam, *grid)


def steered_backward(grad: Tensor, values: Tensor, grid: tuple[int, int], mu: Tensor, scale: Tensor, lam: Tensor, *,
                     head_chunk: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``steered_forward`` for ``values``, ``mu``, ``scale`` and ``lam``."""
    return torch.ops.ssogvit.cpu_steered_mix_backward(grad, values, mu, scale, lam, *grid)


# ---------------------------------------------------------------------------------------------------------------------
# The first use's check against the dense reference


#: The largest relative difference from the dense reference that the first-use check accepts, per dtype.
_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@functools.cache
def _checked(dtype: torch.dtype) -> bool:
    """The kernel's mixing (steered and fixed) and both backwards against the dense reference (autograd through it)
    on small problems with centres inside and outside the grid, narrow and wide kernels and one prefix token, in
    ``dtype``: one warning and ``False`` if they differ. It runs wherever the first use happens, so it sets the
    modes it needs itself: autograd on (not under ``torch.inference_mode``), autocast off (the reference's float32
    matmuls must stay float32), and saved-tensor hooks of its own (the first use can be inside a gradient-checkpointed
    block, whose hooks would take the check's tensors for the block's)."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        g = torch.Generator().manual_seed(0)
        for kind in ("steered", "fixed"):
            worst = _check(kind, dtype, g)
            if not worst < _TOLERANCE[dtype]:
                warnings.warn(f"ssogvit: the CPU kernel's {kind} mixing disagrees with the dense reference (max "
                              f"relative difference {worst:.3g} in {dtype}); using the torch path",
                              RuntimeWarning, stacklevel=4)
                return False
    return True


def _check(kind: str, dtype: torch.dtype, g: torch.Generator) -> float:
    """The largest relative difference between the kernel and autograd through the dense reference, in the output
    and every gradient, on one small problem (tau = 1/2 makes the reference's widths 1 / scale)."""
    heads, gh, gw, r, dh = 2, 4, 5, 3, 3
    values = torch.randn(2, 1 + gh * gw, heads * dh, generator=g, dtype=dtype)
    grad = torch.randn(values.shape, generator=g, dtype=dtype)
    n = 2 if kind == "steered" else 1
    mu = (torch.rand(n, gh * gw, heads, r, 2, generator=g, dtype=dtype) - 0.5) * 12
    s = torch.rand(n, gh * gw, heads, r, 2, generator=g, dtype=dtype) * 3 + 0.1
    lam = torch.rand(n, gh * gw, heads, r, generator=g, dtype=dtype)
    half = torch.tensor(0.5, dtype=dtype)
    if kind == "steered":
        inputs = [t.requires_grad_() for t in (values, mu, s, lam)]
        got = (_steered_mix(*(t.detach() for t in inputs), gh, gw),
               *_steered_mix_backward(grad, *(t.detach() for t in inputs), gh, gw))
        a = dense.dense_steered_matrix(inputs[1], 1 / inputs[2], inputs[3], half, (gh, gw))
    else:
        ky, kx = (dense.dense_axis_kernel(L, mu[0, 0, ..., i], 1 / s[0, 0, ..., i], half) for i, L in
                  enumerate((gh, gw)))
        inputs = [t.requires_grad_() for t in (values, ky, kx, lam[0, 0])]
        got = (_fixed_mix(*(t.detach() for t in inputs)), *_fixed_mix_backward(grad, *(t.detach() for t in inputs)))
        a = torch.einsum("hr,hrac,hrbd->habcd", inputs[3], inputs[1], inputs[2])  # sum_r lam kron(ky, kx)
        a = a.reshape(heads, gh * gw, gh * gw).expand(2, -1, -1, -1)
    want = dense.dense_mix(dense.with_prefix(a, 1), inputs[0])
    want = (want.detach(), *torch.autograd.grad(want, inputs, grad))
    if kind == "fixed":  # and the tables themselves, from the field, with their backward
        field = [t[0, 0, ..., 1].detach().requires_grad_() for t in (mu, s)]
        table = dense.dense_axis_kernel(gw, field[0], 1 / field[1], half)
        g_table = torch.randn(table.shape, generator=g, dtype=dtype)
        plain = [t.detach() for t in field]
        got = (*got, _axis_kernels(*plain, gw), *_axis_kernels_backward(g_table, table.detach(), *plain))
        want = (*want, table.detach(), *torch.autograd.grad(table, field, g_table))
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(got, want))
