"""Run points each in a process of its own (docs/benchmarks.md, "How a point is run"); rows as JSON and CSV. A row's
``status``: ``ok``, ``oom`` (an allocation failed, or SIGKILL: on Linux the OOM killer), ``error``, ``timeout`` or
``skipped`` (a smaller batch of the same configuration already ran out of memory)."""

from __future__ import annotations

import contextlib
import csv
import io
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
from unittest import mock

import torch

from ssogvit.bench.point import run
from ssogvit.outputs import write_text

__all__ = ["CSV_FIELDS", "machine_info", "merge_repeat", "read_results", "run_point", "run_sweep", "write_results"]

#: columns of the CSV file, in order (a row's other keys go to the JSON only)
CSV_FIELDS = ["kind", "label", "family", "size", "mixer", "res", "grid", "tokens", "batch", "mode", "device", "dtype",
              "threads", "warmup", "iters", "blocks", "status", "time_ms", "time_ms_median", "time_ms_spread",
              "images_per_s", "peak_mib", "baseline_mib", "peak_total_mib", "torch_peak_mib", "rss_peak_mib",
              "state_mib", "saved_mib", "grads_mib", "gflops_per_image", "achieved_gflops_per_s", "params",
              "mem_cap_mib", "memory_method", "load_before", "wall_s", "error"]
#: what the fork server imports once, so that each point's process starts with them loaded
PRELOAD = ["torch", "ssogvit.bench.point", "ssogvit.layers", "ssogvit.models"]
LAUNCHERS = ("forkserver", "spawn")
#: a repeat's fields taken with its time, and with each peak-memory measure, where that is the lowest yet
_BEST_FIELDS = {"time_ms": ("time_ms", "time_ms_blocks", "time_ms_median", "time_ms_spread", "images_per_s",
                            "achieved_gflops_per_s", "load_before", "wall_s"),
                "peak_mib": ("peak_mib", "baseline_mib", "peak_total_mib", "state_mib"),
                "torch_peak_mib": ("torch_peak_mib",), "rss_peak_mib": ("rss_peak_mib",)}


def _child(point: dict, conn) -> None:
    conn.send(run(point))
    conn.close()


def run_point(point: dict[str, Any], *, timeout: float | None = None, launcher: str = "forkserver") -> dict:
    """The point merged with its result, run in a process of its own: forked from the fork server, which imported
    torch and ssogvit once and never ran a model (``launcher="forkserver"``), or a new interpreter with
    ``OMP_NUM_THREADS`` set to the point's ``threads`` (``"spawn"``); killed after ``timeout`` seconds."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    ctx = mp.get_context(launcher)
    if launcher == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    row = dict(point, load_before=round(os.getloadavg()[0], 2))
    t0 = time.perf_counter()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(point, send), daemon=True)
    threads = {"OMP_NUM_THREADS": str(point["threads"])} if launcher == "spawn" and point.get("threads") else {}
    with mock.patch.dict(os.environ, threads):  # the spawned interpreter's environment, restored after
        proc.start()
    send.close()
    result, timed_out = None, not recv.poll(timeout)  # a result, or the end of the pipe when the child dies without one
    if timed_out:
        proc.kill()
    else:
        with contextlib.suppress(EOFError):
            result = recv.recv()
    proc.join()
    recv.close()
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    if result is not None:
        return row | result
    if timed_out:
        return row | dict(status="timeout", error=f"no result after {timeout:.0f} s")
    if proc.exitcode == -signal.SIGKILL:
        return row | dict(status="oom", error="child killed by SIGKILL (on Linux, the kernel's out-of-memory killer)")
    return row | dict(status="error", error=f"child exited with {proc.exitcode} without a result")


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Where and with what the results were measured, and the ssogvit commit (and whether its tree was modified)."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": platform.python_version(),
        "torch": torch.__version__, "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here.parent, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return info
    if commit.returncode == 0:
        info.update(ssogvit_commit=commit.stdout.strip(), ssogvit_dirty=bool(dirty.stdout.strip()))
    return info


def csv_text(rows: Sequence[dict], fields: Sequence[str] | None = None) -> str:
    """``rows`` as CSV in the columns ``fields`` (default: every key, first seen first; other keys left out)."""
    table = io.StringIO()
    writer = csv.DictWriter(table, list(fields or dict.fromkeys(k for r in rows for k in r)), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return table.getvalue()


def write_results(rows: Sequence[dict], meta: dict, out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """``{name}.json`` (meta and rows) and ``{name}.csv`` (``CSV_FIELDS``) under ``out_dir``, written atomically."""

    def cell(v: Any) -> Any:
        return (f"{v:.6g}" if isinstance(v, float) else "x".join(map(str, v)) if isinstance(v, list | tuple)
                else "" if v is None else v)

    out, table = Path(out_dir), csv_text([{k: cell(r.get(k)) for k in CSV_FIELDS} for r in rows], CSV_FIELDS)
    text = json.dumps({"meta": meta, "rows": list(rows)}, indent=1, default=str) + "\n"
    return write_text(out / f"{name}.json", text, overwrite=True), write_text(out / f"{name}.csv", table,
                                                                             overwrite=True)


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of a ``write_results`` JSON (in rows from before block timing, the mean is ``time_ms``)."""
    data = json.loads(Path(path).read_text())
    return data["meta"], [r if "time_ms" in r or "time_ms_mean" not in r else r | {"time_ms": r["time_ms_mean"]}
                          for r in data["rows"]]


def merge_repeat(best: dict, new: dict) -> dict:
    """Fold a repeat of a point into its row: the fastest repeat's time fields, the lowest of each peak memory;
    ``repeat_times_ms`` and ``repeat_peaks_mib`` list every repeat (``None`` for one that failed)."""
    ok, out = new.get("status") == "ok", dict(best)
    for key, field in (("repeat_times_ms", "time_ms"), ("repeat_peaks_mib", "peak_mib")):
        out[key] = best.get(key, [best.get(field)]) + [new.get(field) if ok else None]
    out["repeats"] = len(out["repeat_times_ms"])
    if not ok:
        return out
    for key, fields in _BEST_FIELDS.items():
        best_yet = out[key] if isinstance(out.get(key), int | float) else math.inf
        if isinstance(new.get(key), int | float) and new[key] < best_yet:
            out.update({k: new[k] for k in fields if k in new})
    return out


def describe(row: dict) -> str:  # a line of the sweep's log
    head = f"{row.get('label', row.get('model', row.get('mixer')))} res={row.get('res')} batch={row.get('batch')}"
    if row.get("status") != "ok":
        return f"{head}: {row.get('status')} ({row.get('error', '')})"
    mem = f", peak {row['peak_mib']:.1f} MiB" if isinstance(row.get("peak_mib"), int | float) else ""
    timed = f"{row['time_ms']:.2f} ms, {row['images_per_s']:.2f} img/s" if row.get("time_ms") else "not timed"
    return f"{head}: {timed}{mem}"


def run_sweep(points: Iterable[dict[str, Any]], *, out_dir: str | Path | None = None, name: str = "results",
              meta: dict | None = None, timeout: float | None = None, launcher: str = "forkserver",
              log: Callable[[str], None] | None = None, repeats: int = 1,
              repeat_below_ms: float | None = None) -> list[dict]:
    """Run points one after another (a failure is a row; the sweep goes on), the files under ``out_dir`` rewritten
    after every point; a configuration that ran out of memory skips its larger batches. With ``repeats > 1`` the
    points whose first time is below ``repeat_below_ms`` (all if ``None``) run again in rounds, each keeping its best
    repeat (``merge_repeat``): interference on a shared machine only ever adds time."""
    points, log = list(points), log or (lambda s: print(s, file=sys.stderr, flush=True))
    rows, oom_at = [], {}  # oom_at: configuration (everything but the batch) -> the smallest batch out of memory
    for i, point in enumerate(points, 1):
        key = json.dumps({k: v for k, v in point.items() if k not in ("batch", "seed")}, sort_keys=True, default=str)
        if int(point["batch"]) > oom_at.get(key, math.inf):
            row = dict(point, status="skipped", error=f"batch {oom_at[key]} already ran out of memory")
        else:
            row = run_point(point, timeout=timeout, launcher=launcher)
        if row["status"] == "oom":
            oom_at[key] = min(oom_at.get(key, math.inf), int(point["batch"]))
        rows.append(row)
        log(f"[{i}/{len(points)}] {describe(row)}")
        if out_dir is not None:
            write_results(rows, meta or {}, out_dir, name)
    for rnd in range(2, repeats + 1):
        todo = [i for i, r in enumerate(rows) if r.get("status") == "ok"
                and (repeat_below_ms is None or (r.get("time_ms") or 0.0) < repeat_below_ms)]
        if not todo:
            break
        log(f"repeat {rnd}/{repeats}: {len(todo)} points")
        for k, i in enumerate(todo, 1):
            again = run_point(points[i], timeout=timeout, launcher=launcher)
            log(f"[{k}/{len(todo)}] {describe(again)}")
            rows[i] = merge_repeat(rows[i], again)
        if out_dir is not None:
            write_results(rows, meta or {}, out_dir, name)
    return rows
