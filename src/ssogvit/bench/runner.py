"""Run benchmark points, each in its own process, and keep their results as JSON and CSV.

A point is a dict (see ``ssogvit.bench.point``): what to build (``kind`` ``"model"`` or ``"operator"``), the
resolution, batch, iterations, device, precision and an optional memory cap. ``run_point`` runs one in a new
``multiprocessing`` process (forked from the standard library's fork server, which has imported torch and ssogvit
but run nothing, or a new interpreter) and always returns a row: ``status`` is ``"ok"``, ``"oom"`` (an allocation
failed, or the child was killed by SIGKILL, which on Linux is the kernel's OOM killer), ``"error"``, ``"timeout"`` or
``"skipped"`` (a smaller batch of the same configuration already ran out of memory).
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_point", "run_sweep", "merge_repeat", "machine_info", "write_results", "read_results", "CSV_FIELDS"]

#: Columns of the CSV file, in order (a row's other keys go to the JSON only).
CSV_FIELDS = [
    "kind", "label", "family", "size", "mixer", "res", "grid", "tokens", "batch", "mode", "device", "dtype",
    "threads", "warmup", "iters", "blocks", "status", "time_ms", "time_ms_median", "time_ms_spread",
    "images_per_s", "peak_mib", "baseline_mib", "peak_total_mib", "torch_peak_mib", "rss_peak_mib", "state_mib",
    "saved_mib", "grads_mib", "gflops_per_image",
    "achieved_gflops_per_s", "params", "mem_cap_mib", "memory_method", "load_before", "wall_s", "error",
]


def _config_key(point: dict[str, Any]) -> tuple:
    skip = {"batch", "seed"}
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in point.items() if k not in skip))


#: What the fork server imports once, so that each point's process starts with them loaded.
PRELOAD = ["torch", "ssogvit.bench.point", "ssogvit.layers", "ssogvit.models"]
LAUNCHERS = ("forkserver", "spawn")


def _child(point: dict, conn) -> None:
    from ssogvit.bench.point import run

    conn.send(run(point))
    conn.close()


def _context(launcher: str):
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    ctx = mp.get_context(launcher)
    if launcher == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_point(point: dict[str, Any], *, timeout: float | None = None, launcher: str = "forkserver") -> dict:
    """Run one point in a process of its own and return the point merged with its result.

    Args:
        point: what to run (see ``ssogvit.bench.point``).
        timeout: seconds before the point is killed and recorded as ``"timeout"``.
        launcher: the ``multiprocessing`` start method. ``"forkserver"`` (default): forked from a server that has
            imported torch and ssogvit once (``set_forkserver_preload``) and never ran a model, so each point starts
            clean without paying for the imports; ``"spawn"``: a new interpreter, for settings read at start-up
            (``OMP_NUM_THREADS`` is set to the point's ``threads``).
    """
    ctx = _context(launcher)
    row = dict(point)
    row["load_before"] = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(point, send), daemon=True)
    saved_env = os.environ.get("OMP_NUM_THREADS")
    if launcher == "spawn" and point.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(point["threads"])
    try:
        proc.start()
    finally:
        if launcher == "spawn" and point.get("threads"):
            os.environ.pop("OMP_NUM_THREADS") if saved_env is None else os.environ.update(OMP_NUM_THREADS=saved_env)
    send.close()
    result = None
    timed_out = not recv.poll(timeout)  # a result, or the end of the pipe when the child dies without one
    if timed_out:
        proc.kill()
    else:
        try:
            result = recv.recv()
        except EOFError:
            pass
    proc.join()
    recv.close()
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    if result is not None:
        row.update(result)
    elif timed_out:
        row.update(status="timeout", error=f"no result after {timeout:.0f} s")
    elif proc.exitcode == -signal.SIGKILL:
        row.update(status="oom", error="child killed by SIGKILL (on Linux, the kernel's out-of-memory killer)")
    else:
        row.update(status="error", error=f"child exited with {proc.exitcode} without a result")
    return row


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Where and with what the results were measured."""
    import torch

    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info.update(_source_state())
    return info


def _source_state() -> dict[str, Any]:
    """The ssogvit commit the numbers come from, and whether its working tree had uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here.parent, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    if commit.returncode != 0:
        return {}
    return {"ssogvit_commit": commit.stdout.strip(), "ssogvit_dirty": bool(dirty.stdout.strip())}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(rows: Sequence[dict], meta: dict, out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``{name}.json`` (meta and full rows) and ``{name}.csv`` (``CSV_FIELDS``) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out / f"{name}.json", out / f"{name}.csv"
    jpath.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1, default=str) + "\n")
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (_fmt(r.get(k))) for k in CSV_FIELDS})
    return jpath, cpath


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list | tuple):
        return "x".join(str(x) for x in v)
    return "" if v is None else v


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """Read a results JSON written by ``write_results``; returns ``(meta, rows)``.

    Rows written before points were timed in blocks have no ``time_ms``; their mean time per call stands in for it.
    """
    data = json.loads(Path(path).read_text())
    rows = [r if "time_ms" in r or "time_ms_mean" not in r else r | {"time_ms": r["time_ms_mean"]}
            for r in data["rows"]]
    return data["meta"], rows


def run_sweep(
    points: Iterable[dict[str, Any]],
    *,
    out_dir: str | Path | None = None,
    name: str = "results",
    meta: dict | None = None,
    timeout: float | None = None,
    skip_after_oom: bool = True,
    launcher: str = "forkserver",
    log: Callable[[str], None] | None = None,
    repeats: int = 1,
    repeat_below_ms: float | None = None,
) -> list[dict]:
    """Run points one after another, each in its own process; a failed point is recorded and the sweep goes on.

    With ``out_dir``, the JSON and CSV files are rewritten after every point, so a stopped sweep keeps what it did.
    With ``skip_after_oom``, a point whose configuration (everything but the batch) ran out of memory at a smaller
    batch is recorded as ``"skipped"`` without running.

    With ``repeats > 1`` the whole list is run again ``repeats - 1`` times (each point in a fresh process again, the
    rounds one after another so that a point's repeats are minutes apart), for the points whose first time is
    below ``repeat_below_ms`` (all, if ``None``, or if the points are not timed). On a shared machine the speed of a
    whole process varies, so each point keeps its fastest repeat (its time fields) and the lowest of each peak
    memory (``merge_repeat``).
    """
    points = list(points)
    opts = dict(name=name, meta=meta, timeout=timeout, launcher=launcher, log=log)
    rows = _run_round(points, out_dir=out_dir, skip_after_oom=skip_after_oom, **opts)
    for rnd in range(2, repeats + 1):
        todo = [
            i for i, r in enumerate(rows)
            if r.get("status") == "ok" and (repeat_below_ms is None or (r.get("time_ms") or 0.0) < repeat_below_ms)
        ]
        if not todo:
            break
        (log or _log)(f"repeat {rnd}/{repeats}: {len(todo)} points")
        again = _run_round([points[i] for i in todo], out_dir=None, skip_after_oom=False, **opts)
        for i, row in zip(todo, again):
            rows[i] = merge_repeat(rows[i], row)
        if out_dir is not None:
            write_results(rows, meta or {}, out_dir, name)
    return rows


_TIME_FIELDS = ("time_ms", "time_ms_blocks", "time_ms_median", "time_ms_spread", "images_per_s",
                "achieved_gflops_per_s", "load_before", "wall_s")
#: Each peak-memory measure and the fields taken with it from the repeat where it is lowest.
_PEAK_FIELDS = {"peak_mib": ("peak_mib", "baseline_mib", "peak_total_mib", "state_mib"),
                "torch_peak_mib": ("torch_peak_mib",), "rss_peak_mib": ("rss_peak_mib",)}


def merge_repeat(best: dict, new: dict) -> dict:
    """Fold a repeat of a point into its row: the fastest repeat's time fields, the lowest of each peak memory.

    ``repeat_times_ms`` and ``repeat_peaks_mib`` list every repeat (``None`` for one that failed).
    """
    out = dict(best)
    out.setdefault("repeat_times_ms", [best.get("time_ms")])
    out.setdefault("repeat_peaks_mib", [best.get("peak_mib")])
    ok = new.get("status") == "ok"
    out["repeat_times_ms"] = out["repeat_times_ms"] + [new.get("time_ms") if ok else None]
    out["repeat_peaks_mib"] = out["repeat_peaks_mib"] + [new.get("peak_mib") if ok else None]
    out["repeats"] = len(out["repeat_times_ms"])
    if not ok:
        return out
    if isinstance(new.get("time_ms"), int | float) and new["time_ms"] < (out.get("time_ms") or math.inf):
        out.update({k: new[k] for k in _TIME_FIELDS if k in new})
    for key, fields in _PEAK_FIELDS.items():
        if isinstance(new.get(key), int | float) and (
            not isinstance(out.get(key), int | float) or new[key] < out[key]
        ):
            out.update({k: new[k] for k in fields if k in new})
    return out


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _run_round(
    points: list[dict], *, out_dir, name: str, meta: dict | None, timeout: float | None, skip_after_oom: bool,
    launcher: str, log: Callable[[str], None] | None,
) -> list[dict]:
    log = log or _log
    rows: list[dict] = []
    oom_at: dict[tuple, int] = {}
    for i, point in enumerate(points, 1):
        key = _config_key(point)
        if skip_after_oom and key in oom_at and int(point["batch"]) > oom_at[key]:
            row = dict(point, status="skipped", error=f"batch {oom_at[key]} already ran out of memory")
        else:
            row = run_point(point, timeout=timeout, launcher=launcher)
            if row["status"] == "oom":
                oom_at[key] = min(oom_at.get(key, 1 << 62), int(point["batch"]))
        rows.append(row)
        log(f"[{i}/{len(points)}] {describe(row)}")
        if out_dir is not None:
            write_results(rows, meta or {}, out_dir, name)
    return rows


def describe(row: dict) -> str:
    """One line about a finished point."""
    head = f"{row.get('label', row.get('model', row.get('mixer')))} res={row.get('res')} batch={row.get('batch')}"
    if row.get("status") != "ok":
        return f"{head}: {row.get('status')} ({row.get('error', '')})"
    mem = row.get("peak_mib")
    mem_s = f", peak {mem:.1f} MiB" if isinstance(mem, int | float) else ""
    time_s = f"{row['time_ms']:.2f} ms, {row['images_per_s']:.2f} img/s" if row.get("time_ms") else "not timed"
    return f"{head}: {time_s}{mem_s}"
