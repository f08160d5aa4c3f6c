"""Run benchmark points, each in its own process, and keep their results as JSON and CSV.

A point is a dict (see ``ssogvit.bench._worker``): what to build (``kind`` ``"model"`` or ``"operator"``), the
resolution, batch, iterations, device, precision and an optional memory cap. ``run_point`` runs one in a new
process (forked from a server that has imported torch and ssogvit but run nothing, or a new interpreter) and always
returns a row: ``status`` is ``"ok"``, ``"oom"`` (an allocation failed, or the child was
killed by SIGKILL, which on Linux is the kernel's OOM killer), ``"error"``, ``"timeout"`` or ``"skipped"`` (a smaller
batch of the same configuration already ran out of memory).
"""

from __future__ import annotations

import atexit
import csv
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ssogvit.bench._worker import RESULT_MARKER

__all__ = ["run_point", "run_sweep", "merge_repeat", "machine_info", "write_results", "read_results", "CSV_FIELDS"]

#: Columns of the CSV file, in order (a row's other keys go to the JSON only).
CSV_FIELDS = [
    "kind", "label", "family", "size", "mixer", "res", "grid", "tokens", "batch", "mode", "device", "dtype",
    "threads", "warmup", "iters", "status", "time_ms_mean", "time_ms_median", "time_ms_min", "time_ms_std",
    "images_per_s", "peak_mib", "baseline_mib", "peak_total_mib", "torch_peak_mib", "gflops_per_image",
    "achieved_gflops_per_s", "params", "mem_cap_mib", "memory_method", "load_before", "wall_s", "error",
]


def _config_key(point: dict[str, Any]) -> tuple:
    skip = {"batch", "seed"}
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in point.items() if k not in skip))


class _ForkServer:
    """The parent's handle on ``python -m ssogvit.bench._server`` (started on first use, restarted if it dies)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ssogvit.bench._server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        if self._reply() is None:
            raise RuntimeError("the benchmark fork server did not start (see the messages above)")

    def _reply(self) -> dict | None:
        from ssogvit.bench._server import REPLY_MARKER

        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_MARKER):
                return json.loads(line[len(REPLY_MARKER):])
        return None

    def run(self, point: dict, timeout: float | None) -> tuple[dict | None, int | None, bool]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"point": point, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if reply is None:
            self.proc = None
            return None, None, False
        return reply["result"], reply["code"], reply["timed_out"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc = None


_SERVER = _ForkServer()
atexit.register(_SERVER.close)


def run_point(point: dict[str, Any], *, timeout: float | None = None, launcher: str = "forkserver") -> dict:
    """Run one point in a new process and return the point merged with its result.

    Args:
        point: what to run (see ``ssogvit.bench._worker``).
        timeout: seconds before the point is killed and recorded as ``"timeout"``.
        launcher: ``"forkserver"`` (default): a process forked from a server (``ssogvit.bench._server``) that has
            only imported torch and ssogvit, never run a model, so each point starts clean without paying for the
            imports again;
            ``"subprocess"``: a new interpreter (``python -m ssogvit.bench._worker``), for settings read at start-up
            such as ``OMP_NUM_THREADS``.
    """
    row = dict(point)
    row["load_before"] = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    if launcher == "forkserver":
        result, code, timed_out = _SERVER.run(point, timeout)
    elif launcher == "subprocess":
        result, code, timed_out = _run_subprocess(point, timeout)
    else:
        raise ValueError(f"unknown launcher {launcher!r}; expected 'forkserver' or 'subprocess'")
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    if result is not None:
        row.update(result)
    elif timed_out:
        row.update(status="timeout", error=f"no result after {timeout:.0f} s")
    elif code == -signal.SIGKILL:
        row.update(status="oom", error="child killed by SIGKILL (on Linux, the kernel's out-of-memory killer)")
    else:
        row.update(status="error", error=f"child exited with {code} without a result")
    return row


def _run_subprocess(point: dict, timeout: float | None) -> tuple[dict | None, int | None, bool]:
    env = dict(os.environ)
    if point.get("threads"):
        env["OMP_NUM_THREADS"] = str(point["threads"])
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ssogvit.bench._worker"],
            input=json.dumps(point), capture_output=True, text=True, timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired:
        return None, None, True
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):]), proc.returncode, False
    return None, proc.returncode, False


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
    """Read a results JSON written by ``write_results``; returns ``(meta, rows)``."""
    data = json.loads(Path(path).read_text())
    return data["meta"], data["rows"]


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
    rounds one after another so that a point's repeats are minutes apart), for the points whose first median time is
    below ``repeat_below_ms`` (all, if ``None``). On a shared machine the speed of a whole process varies (the same
    point's median moved by up to 50% between processes here), so each point keeps the repeat with the lowest
    median (its time fields) and the lowest peak memory; ``repeat_medians_ms`` and ``repeat_peaks_mib`` list all.
    """
    points = list(points)
    opts = dict(name=name, meta=meta, timeout=timeout, launcher=launcher, log=log)
    rows = _run_round(points, out_dir=out_dir, skip_after_oom=skip_after_oom, **opts)
    for rnd in range(2, repeats + 1):
        todo = [
            i for i, r in enumerate(rows)
            if r.get("status") == "ok" and (repeat_below_ms is None or r["time_ms_median"] < repeat_below_ms)
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


_TIME_FIELDS = ("time_ms_mean", "time_ms_median", "time_ms_min", "time_ms_std", "images_per_s",
                "achieved_gflops_per_s", "load_before", "wall_s")
#: Each peak-memory measure and the fields taken with it from the repeat where it is lowest.
_PEAK_FIELDS = {"peak_mib": ("peak_mib", "baseline_mib", "peak_total_mib"), "torch_peak_mib": ("torch_peak_mib",)}


def merge_repeat(best: dict, new: dict) -> dict:
    """Fold a repeat of a point into its row: the lowest median's time fields, the lowest peak memory."""
    out = dict(best)
    out.setdefault("repeat_medians_ms", [best.get("time_ms_median")])
    out.setdefault("repeat_peaks_mib", [best.get("peak_mib")])
    if new.get("status") != "ok":
        out["repeat_medians_ms"] = out["repeat_medians_ms"] + [None]
        out["repeat_peaks_mib"] = out["repeat_peaks_mib"] + [None]
        return out
    out["repeat_medians_ms"] = out["repeat_medians_ms"] + [new.get("time_ms_median")]
    out["repeat_peaks_mib"] = out["repeat_peaks_mib"] + [new.get("peak_mib")]
    if new["time_ms_median"] < out["time_ms_median"]:
        out.update({k: new[k] for k in _TIME_FIELDS if k in new})
    for key, fields in _PEAK_FIELDS.items():
        if isinstance(new.get(key), int | float) and (
            not isinstance(out.get(key), int | float) or new[key] < out[key]
        ):
            out.update({k: new[k] for k in fields if k in new})
    out["repeats"] = len(out["repeat_medians_ms"])
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
    return f"{head}: {row['time_ms_mean']:.2f} ms, {row['images_per_s']:.2f} img/s{mem_s}"
