"""Peak memory of one call, on CUDA (the caching allocator's counters) and on CPU (the kernel's resident set).

CPU method (Linux): release the C heap's free pages (``malloc_trim``), make glibc serve every block of 64 KiB or
more with its own mapping so that a freed tensor leaves the resident set at once (``mallopt``), reset the kernel's
resident high-water mark (``echo 5 > /proc/self/clear_refs``), read ``VmRSS``, make the call, read ``VmHWM``. The
difference is the peak of what the call added to the process: its activations, temporaries and output, including
memory allocated outside PyTorch (oneDNN scratch, OpenMP). Caveats, also in ``docs/benchmarks.md``: it counts pages
touched, not bytes requested (an allocation never written is not counted, one partly written counts its pages); it
needs a fresh process per point (a parent's or earlier point's heap would blur it); where ``clear_refs`` cannot be
written it falls back to ``ru_maxrss``, which cannot go below the process's earlier peak, and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from collections.abc import Callable

import torch

__all__ = ["cpu_peak_call", "torch_peak_call", "cuda_peak_call", "status_kib", "cap_address_space", "limit_arenas"]

_M_TRIM_THRESHOLD = -1
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3
_MIB = 1024 * 1024


def status_kib(*keys: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in KiB (e.g. ``VmRSS``, ``VmHWM``, ``VmSize``)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0])
    return out


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _release_heap() -> bool:
    """Return free heap pages to the OS and map large blocks individually from now on; True if glibc obliged."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024))
    libc.malloc_trim(0)
    return ok


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_call(fn: Callable[[], object]) -> dict[str, float | str]:
    """Run ``fn()`` once and return the peak resident memory it added, in MiB, and how it was measured."""
    import gc

    gc.collect()
    heap = _release_heap()
    if _reset_hwm():
        before = status_kib("VmRSS")["VmRSS"]
        out = fn()
        peak = status_kib("VmHWM")["VmHWM"]
        del out
        method = "clear_refs+VmHWM" + ("" if heap else " (glibc heap not trimmed)")
        return {"peak_mib": (peak - before) / 1024, "baseline_mib": before / 1024, "memory_method": method}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = status_kib("VmRSS")["VmRSS"]
    out = fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    return {
        "peak_mib": max(after - max(before, rss), 0) / 1024,
        "baseline_mib": rss / 1024,
        "memory_method": "ru_maxrss (clear_refs unavailable: a lower bound, blurred by earlier peaks)",
    }


def torch_peak_call(fn: Callable[[], object]) -> dict[str, float | None]:
    """Run ``fn()`` once under ``torch.profiler`` (``profile_memory=True``) and return ``torch_peak_mib``: the
    highest total of PyTorch's CPU allocations during the call, above what was allocated before it.

    The allocator's view: it sees every tensor but nothing allocated outside PyTorch (BLAS packing buffers, the C
    heap's fragmentation), which the resident-memory figure of ``cpu_peak_call`` includes. ``None`` when the profiler
    returns no allocation events.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted(
        (ev.start_ns(), ev.nbytes()) for ev in prof.profiler.kineto_results.events() if ev.name() == "[memory]"
    )
    if not events:
        return {"torch_peak_mib": None}
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return {"torch_peak_mib": peak / _MIB}


def cuda_peak_call(fn: Callable[[], object], device: torch.device) -> dict[str, float | str]:
    """Run ``fn()`` once on CUDA; ``peak_mib`` is ``max_memory_allocated`` above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return {
        "peak_mib": (peak - before) / _MIB,
        "baseline_mib": before / _MIB,
        "peak_total_mib": peak / _MIB,
        "memory_method": "torch.cuda.max_memory_allocated",
    }


def limit_arenas(count: int) -> bool:
    """Let glibc create at most ``count`` malloc arenas from now on (``mallopt(M_ARENA_MAX)``)."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, count))


def cap_address_space(cap_mib: float) -> int:
    """Let this process map at most ``cap_mib`` more MiB of address space (``RLIMIT_AS``); returns the limit in bytes.

    A coarse cap, meant for forcing a point out of memory: it counts reserved address space (thread stacks, malloc
    arenas), not resident pages.
    """
    size = status_kib("VmSize")["VmSize"] * 1024
    limit = size + int(cap_mib * _MIB)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit
