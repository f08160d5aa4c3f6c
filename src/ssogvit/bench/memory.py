"""Peak memory of one call (docs/benchmarks.md says which figure to read when).

- CUDA: ``max_memory_allocated`` above what was allocated before the call (``cuda_peak_call``).
- CPU, allocator (the default): the highest running total of PyTorch's allocation events during the call, replayed
  from ``torch.profiler`` (``torch_peak_call``): bytes requested, the same in every process; blind to memory
  allocated outside PyTorch.
- CPU, resident (``cpu_peak_call``, Linux): the heap's free pages returned (``malloc_trim``), blocks of 64 KiB and more
  mapped on their own (``mallopt``) so that freed tensors leave at once, the kernel's high-water mark reset
  (``echo 5 > /proc/self/clear_refs``), then ``VmHWM - VmRSS`` around the call. Pages touched, not bytes, in a fresh
  process; where ``clear_refs`` cannot be written, ``ru_maxrss``, a lower bound, and it says so.
- What a forward saves for backward, per module (``saved_for_backward``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import resource
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["cap_address_space", "cpu_peak_call", "cuda_peak_call", "limit_arenas", "saved_for_backward",
           "status_kib", "torch_peak_call"]

_MIB = 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def status_kib(*keys: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ``VmSize``)."""
    with open("/proc/self/status") as f:
        fields = (line.partition(":") for line in f)
        return {k: int(v.split()[0]) for k, _, v in fields if k in keys}


def _mallopt(param: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    return bool(hasattr(libc, "mallopt") and libc.mallopt(param, value))


def limit_arenas(count: int) -> bool:
    """Let glibc create at most ``count`` malloc arenas from now on (each reserves 64 MiB of address space)."""
    return _mallopt(_M_ARENA_MAX, count)


def cap_address_space(cap_mib: float) -> int:
    """Let this process map at most ``cap_mib`` more MiB of address space (``RLIMIT_AS``); returns the limit in bytes.
    Coarse (reserved space, not resident pages): meant for forcing a point out of memory."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = status_kib("VmSize")["VmSize"] * 1024 + int(cap_mib * _MIB)
    limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def cpu_peak_call(fn: Callable[[], object]) -> dict[str, float | str]:
    """Run ``fn()`` once and return the peak resident memory it added (``peak_mib``), the resident memory before it
    (``baseline_mib``) and how it was measured."""
    gc.collect()
    heap = _mallopt(_M_MMAP_THRESHOLD, 64 * 1024) and _mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
    if heap:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # no high-water reset: the process's peak so far, a lower bound
        before, rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, status_kib("VmRSS")["VmRSS"]
        out = fn()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        del out
        return {"peak_mib": max(after - max(before, rss), 0) / 1024, "baseline_mib": rss / 1024,
                "memory_method": "ru_maxrss (clear_refs unavailable: a lower bound, blurred by earlier peaks)"}
    before = status_kib("VmRSS")["VmRSS"]
    out = fn()
    peak = status_kib("VmHWM")["VmHWM"]  # read with the output alive: the kernel's high-water mark lags behind a free
    del out
    return {"peak_mib": (peak - before) / 1024, "baseline_mib": before / 1024,
            "memory_method": "clear_refs+VmHWM" + ("" if heap else " (glibc heap not trimmed)")}


def _storages(objs: Iterable[object]) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of every storage held by modules (parameters, gradients, buffers), optimizers (state)
    and tensors, each once."""
    tensors: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, torch.nn.Module):
            params = list(obj.parameters())
            tensors += params + list(obj.buffers()) + [p.grad for p in params if p.grad is not None]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def torch_peak_call(fn: Callable[[], object], *, kept: Iterable[object] = ()) -> dict[str, float | None]:
    """Run ``fn()`` once under ``torch.profiler(profile_memory=True)``: ``torch_peak_mib`` is the highest total of
    PyTorch's CPU allocations during the call above what was allocated before it; ``kept`` (modules, optimizers,
    tensors) is what lives across the call, ``state_mib``, and ``peak_total_mib = state_mib + torch_peak_mib``.
    ``None`` when the profiler records no allocation."""
    from torch.profiler import ProfilerActivity, profile

    state = sum(_storages([k for k in kept if k is not None]).values()) / _MIB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    if not events:
        return {"torch_peak_mib": None}
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return {"torch_peak_mib": peak / _MIB, "state_mib": state, "peak_total_mib": state + peak / _MIB}


def saved_for_backward(module: torch.nn.Module, forward: Callable[[], object], *,
                       exclude: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
    """What one forward of ``module`` saves for backward (``saved_tensors_hooks``), per module.

    Each saved storage counts once, for the innermost module running when it is saved, modules at the same place in
    every block grouped (``blocks.*.attn``); parameters, buffers and ``exclude`` (the input) are left out. All of it is
    alive when the forward ends and every gradient when backward ends, so the larger sum is a lower bound of a step.

    Returns:
        ``saved_mib``, ``saved_by_module`` (``{group: [MiB, applications]}``) and ``grads_mib``.
    """
    skip = set(_storages([module, *exclude]))
    stack: list[str] = []
    calls: dict[str, int] = {}
    saved: dict[str, int] = {}

    def enter(name):
        def hook(_m, _args) -> None:
            stack.append(name)
            calls[name] = calls.get(name, 0) + 1
        return hook

    def leave(_m, _args, _out) -> None:
        stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() and st.data_ptr() not in skip:
            skip.add(st.data_ptr())
            where = stack[-1] if stack else "(model)"
            saved[where] = saved.get(where, 0) + st.nbytes()
        return t

    handles = []
    for name, m in module.named_modules():  # blocks.3.attn.v -> blocks.*.attn.v
        group = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name) or "(model)"
        handles += [m.register_forward_pre_hook(enter(group)), m.register_forward_hook(leave)]
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
