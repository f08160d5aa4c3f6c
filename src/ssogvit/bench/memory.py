"""Peak memory of one call (docs/benchmarks.md, "Peak memory: what is measured"): CUDA's allocator, PyTorch's CPU
allocation events, the resident set; what a forward saves for backward, per module."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import itertools
import re
import resource
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["cap_address_space", "cpu_peak_call", "cuda_peak_call", "keep_freed_memory", "saved_for_backward",
           "status_kib", "torch_peak_call"]

_MIB = 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def status_kib(*keys: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ``VmSize``)."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in keys}


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def cap_address_space(cap_mib: float) -> int:
    """Let this process map at most ``cap_mib`` more MiB (``RLIMIT_AS``: reserved space, not resident pages), with two
    malloc arenas at most (each reserves 64 MiB of address space, which the cap counts); returns the limit in bytes."""
    if (libc := _libc()) is not None:
        libc.mallopt(_M_ARENA_MAX, 2)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = status_kib("VmSize")["VmSize"] * 1024 + int(cap_mib * _MIB)
    limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def keep_freed_memory() -> bool:
    """Let glibc keep what a timed step frees (``mallopt``: no trimming, no ``mmap`` below 32 MiB, its largest), so
    that each step reuses its pages instead of faulting them in again: left to its heuristics, glibc returned and
    refaulted about 10 MB a step of a ViT-B mixer's training at 224 px, a fifth of SSoG's step there and a varying
    share of every point's. ``cpu_peak_call`` sets its own thresholds. ``False`` where there is no glibc."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
                                     and libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20))


def cpu_peak_call(fn: Callable[[], object]) -> dict[str, float | str]:
    """Run ``fn()`` once: ``peak_mib``, the resident memory it added at its peak, ``baseline_mib`` and the method
    (``ru_maxrss``, a lower bound, where ``/proc/self/clear_refs`` cannot be written)."""
    gc.collect()
    libc = _libc()
    # freed blocks of 64 KiB or more leave the resident set at once, and the heap's free pages go back first
    heap = libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, 65536) and libc.mallopt(_M_TRIM_THRESHOLD, 131072))
    if heap:
        libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        before, rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, status_kib("VmRSS")["VmRSS"]
        _out = fn()  # alive while the peak is read
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - max(before, rss), 0)
        return {"peak_mib": peak / 1024, "baseline_mib": rss / 1024,
                "memory_method": "ru_maxrss (clear_refs unavailable: a lower bound, blurred by earlier peaks)"}
    before = status_kib("VmRSS")["VmRSS"]
    _out = fn()
    peak = status_kib("VmHWM")["VmHWM"]  # read with the output alive: the kernel's high-water mark lags behind a free
    return {"peak_mib": (peak - before) / 1024, "baseline_mib": before / 1024,
            "memory_method": "clear_refs+VmHWM" + ("" if heap else " (glibc heap not trimmed)")}


def _storages(objs: Iterable[object]) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of the storages of modules (parameters, gradients, buffers), optimizers, tensors."""
    tensors: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            params = list(obj.parameters())
            tensors += params + list(obj.buffers()) + [p.grad for p in params if p.grad is not None]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        elif isinstance(obj, torch.Tensor):
            tensors.append(obj)
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def torch_peak_call(fn: Callable[[], object], *, kept: Iterable[object] = ()) -> dict[str, float | None]:
    """Run ``fn()`` once under ``torch.profiler(profile_memory=True)``: ``torch_peak_mib``, the highest total of
    PyTorch's allocations during the call above what was allocated before (``None`` if none was recorded);
    ``state_mib``, what ``kept`` (modules, optimizers, tensors) holds across it; ``peak_total_mib``, their sum."""
    state = sum(_storages([k for k in kept if k is not None]).values()) / _MIB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    if not events:
        return {"torch_peak_mib": None}
    peak = max(0, *itertools.accumulate(nbytes for _, nbytes in events))
    return {"torch_peak_mib": peak / _MIB, "state_mib": state, "peak_total_mib": state + peak / _MIB}


def saved_for_backward(module: torch.nn.Module, forward: Callable[[], object], *,
                       exclude: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
    """What one forward of ``module`` saves for backward: ``saved_mib``, ``saved_by_module`` (``{group: [MiB,
    applications]}``, each storage counted once for the innermost module running, the same place in every block one
    group: ``blocks.*.attn``; parameters, buffers and ``exclude`` left out) and ``grads_mib``. All saved tensors are
    alive when the forward ends, all gradients when backward ends: the larger is a lower bound of a step."""
    skip, stack, calls, saved = set(_storages([module, *exclude])), [], Counter(), Counter()

    def enter(name: str, _m, _args) -> None:
        stack.append(name)
        calls[name] += 1

    def leave(_m, _args, _out) -> None:  # returns None: a forward hook's value would replace the output
        stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key and key not in skip:
            skip.add(key)
            saved[stack[-1] if stack else "(model)"] += t.untyped_storage().nbytes()
        return t

    handles = []
    for name, m in module.named_modules():  # blocks.3.attn.v -> blocks.*.attn.v
        group = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name) or "(model)"
        handles += [m.register_forward_pre_hook(functools.partial(enter, group)), m.register_forward_hook(leave)]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
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
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mib": (peak - before) / _MIB, "baseline_mib": before / _MIB, "peak_total_mib": peak / _MIB,
            "memory_method": "torch.cuda.max_memory_allocated"}
