"""Peak memory of one call: on CUDA the caching allocator's counters; on CPU PyTorch's allocations (``torch_peak_call``,
the default: the bytes tensors ask for, the same in every process) or the kernel's resident set (``cpu_peak_call``);
and what a forward saves for backward (``saved_for_backward``). docs/benchmarks.md says which to read when.

Resident method (Linux): release the C heap's free pages (``malloc_trim``), make glibc serve every block of 64 KiB or
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
import re
import resource
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["cpu_peak_call", "torch_peak_call", "saved_for_backward", "cuda_peak_call", "status_kib",
           "cap_address_space", "limit_arenas"]

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


def _storages(objs: Iterable[object]) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of every tensor storage held by ``objs``: modules (parameters, their gradients,
    buffers), optimizers (their state) and tensors; each storage once."""
    tensors: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, torch.nn.Module):
            tensors += list(obj.parameters()) + list(obj.buffers())
            tensors += [p.grad for p in obj.parameters() if p.grad is not None]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    out = {}
    for t in tensors:
        st = t.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
    return out


def torch_peak_call(fn: Callable[[], object], *, kept: Iterable[object] = ()) -> dict[str, float | None]:
    """Run ``fn()`` once under ``torch.profiler`` (``profile_memory=True``) and return ``torch_peak_mib``: the
    highest total of PyTorch's CPU allocations during the call, above what was allocated before it.

    The allocator's view: it counts the bytes every tensor asks for, so it does not depend on which pages the C heap
    happens to have resident, and it repeats between processes (docs/benchmarks.md); it does not see memory
    allocated outside PyTorch (BLAS packing buffers, oneDNN scratch), which the resident figure of ``cpu_peak_call``
    includes. ``kept`` (modules, optimizers, tensors) is what lives across the call; its bytes are
    ``state_mib`` and ``peak_total_mib = state_mib + torch_peak_mib``. ``None`` when the profiler records no
    allocation.
    """
    from torch.profiler import ProfilerActivity, profile

    state = sum(_storages([k for k in kept if k is not None]).values()) / _MIB
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
    return {"torch_peak_mib": peak / _MIB, "state_mib": state, "peak_total_mib": state + peak / _MIB}


def _group(name: str) -> str:
    """``blocks.3.attn.v`` -> ``blocks.*.attn.v``: one group for the same place in every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name) or "(model)"


def saved_for_backward(module: torch.nn.Module, forward: Callable[[], object], *,
                       exclude: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
    """What one forward of ``module`` saves for backward (``torch.autograd.graph.saved_tensors_hooks``).

    Every tensor autograd saves is attributed to the innermost module running when it is saved, modules at the same
    place in every block grouped (``blocks.*.attn``); each storage is counted once, and parameters, buffers and
    ``exclude`` (the input) are left out: they live before and after the step. All of these tensors are alive at
    once when the forward ends, and every parameter's gradient is alive at once when backward ends, so the larger
    of the two sums is a lower bound of what a training step adds to memory.

    Returns:
        ``saved_mib`` (total), ``saved_by_module``: ``{group: [MiB, applications]}`` (``applications``: how many
        times the group's modules ran, e.g. 12 for one per block of a 12-block ViT), and ``grads_mib``: the bytes
        of the trainable parameters' gradients.
    """
    skip = set(_storages([module, *exclude]))
    stack: list[str] = []
    calls: dict[str, int] = {}
    saved: dict[str, int] = {}
    seen: set[int] = set()

    def pre(name):
        def hook(_m, _args):
            stack.append(name)
            calls[name] = calls.get(name, 0) + 1
        return hook

    def post(_m, _args, _out):
        stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key and key not in skip and key not in seen:
            seen.add(key)
            where = stack[-1] if stack else "(model)"
            saved[where] = saved.get(where, 0) + st.nbytes()
        return t

    handles = []
    for name, m in module.named_modules():
        handles += [m.register_forward_pre_hook(pre(_group(name))), m.register_forward_hook(post)]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        del out
    finally:
        for h in handles:
            h.remove()
    by = {k: [v / _MIB, calls.get(k, 1)] for k, v in sorted(saved.items(), key=lambda kv: -kv[1])}
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return {"saved_mib": sum(saved.values()) / _MIB, "saved_by_module": by, "grads_mib": grads / _MIB}


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
