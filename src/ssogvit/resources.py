"""Machine resources: how much memory this process may use, which devices this machine has.

Sizes: `check_memory` refuses a request whose estimated bytes exceed what this process may use (the least of the
physical memory, the cgroup limit and the room left under `RLIMIT_AS`), with the estimate, before anything is
allocated. Devices: `check_device` refuses `cuda` on a machine without CUDA as such, not as a bad file
(docs/DEVELOPING.md, "How a command takes input and writes output").

This module imports the standard library, torch and `ssogvit.errors` only.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import torch

from ssogvit.errors import InputError, refused

__all__ = ["MemoryLimitError", "check_device", "check_memory", "format_bytes", "memory_limit"]


class MemoryLimitError(InputError):
    """A request whose estimated memory exceeds what this process may use; the message gives the estimate."""


def format_bytes(n: float) -> str:
    """`1.5 GB`, `320 MB`, `12 kB` (powers of 1000)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a near-2**63 value: no limit
            return int(text)
    return None


def _address_space_in_use() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_limit() -> tuple[int, str]:
    """The bytes this process may still use and which limit says so: the least of the physical memory, the cgroup
    limit and the room left under `RLIMIT_AS` (`ulimit -v`)."""
    limits = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the physical memory"))
    except (ValueError, OSError):
        pass
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append((cgroup, "the cgroup memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((max(0, soft - _address_space_in_use()), "the room left under RLIMIT_AS (ulimit -v)"))
    return min(limits) if limits else (1 << 62, "no known limit")


def check_memory(nbytes: float, what: str, argument: str) -> None:
    """Refuse (`MemoryLimitError` naming `argument`) a request estimated at `nbytes` that this process cannot hold."""
    limit, source = memory_limit()
    if nbytes > limit:
        raise MemoryLimitError(f"{argument}: {what} needs at least {format_bytes(nbytes)}, more than "
                               f"{source} allows ({format_bytes(limit)})", argument=argument)


def check_device(device: Any, argument: str = "device", *, compute: bool = False) -> torch.device:
    """`device` as a `torch.device` this machine has: `cuda` without CUDA is refused as such (not as a bad file);
    with `compute` (a command that computes on it) not `meta`, which holds shapes and no values."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise refused(argument, device, "a torch device such as 'cpu', 'cuda' or 'cuda:0'",
                      wrong_type=not isinstance(device, (str, torch.device))) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{argument}={str(device)!r}: CUDA is not available on this machine "
                             f"(torch.cuda.is_available() is False); use 'cpu'", argument=argument)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"{argument}={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s)", argument=argument)
    elif compute and dev.type == "meta":
        raise InputError(f"{argument}={str(device)!r}: the meta device holds shapes and no values, so nothing can be "
                         "computed on it; use 'cpu' or 'cuda'", argument=argument)
    elif dev.type not in ("cpu", "meta", "mps") or (dev.type == "mps" and not torch.backends.mps.is_available()):
        raise InputError(f"{argument}={str(device)!r}: expected 'cpu' or 'cuda' (a device this machine has)",
                         argument=argument)
    return dev
