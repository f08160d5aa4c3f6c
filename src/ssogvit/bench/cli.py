"""``ssogvit bench models|operator|flops``: the efficiency benchmarks of docs/benchmarks.md, as a command line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from ssogvit.errors import ArgumentParser, UsageError

RESOLUTIONS = [224, 384, 512, 640, 768, 1024]
GPU_BATCHES = [8, 16, 32, 64, 128, 256, 512]
CPU_MODEL_BATCHES = [1, 4]
TABLE4_RESOLUTIONS = [224, 384, 512, 640, 768]


def _device(arg: str) -> str:
    import torch

    if arg == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return arg


def _dtype(arg: str, device: str) -> str:
    if arg == "auto":
        return "fp16" if device.startswith("cuda") else "fp32"
    return arg


def _kv(items: list[str] | None) -> dict[str, Any]:
    from ssogvit.bench.operator_sweep import _value

    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"--set expects key=value, got {item!r}")
        out[key] = _value(value)
    return out


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--res", type=int, nargs="+", default=RESOLUTIONS, help="image resolutions (default %(default)s)")
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="batch sizes (default: models 8..512 on CUDA, 1 4 on CPU; operator 8)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up calls (default 10)")
    p.add_argument("--iters", type=int, default=50,
                   help="calls per timed block (default 50; 0: no timing, memory only)")
    p.add_argument("--blocks", type=int, default=3,
                   help="timed blocks per point (torch.utils.benchmark.Timer.timeit); the fastest is kept (default 3)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="autocast precision (default: fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--mode", default="inference", choices=["inference", "train"],
                   help="inference (torch.inference_mode) or a training step (forward, backward, AdamW step)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each point's process")
    p.add_argument("--mem-cap-mib", type=float, default=None,
                   help="memory cap per point: CPU, address space the point may add (RLIMIT_AS); CUDA, a memory "
                        "fraction. A point that exceeds it is recorded as out of memory")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory call")
    p.add_argument("--memory", default="allocator", choices=["allocator", "resident", "both"],
                   help="CPU peak memory: bytes PyTorch's allocator hands out (default; repeatable between "
                        "processes), the resident set, or both (peak_mib is then the allocator's)")
    p.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) in each point")
    p.add_argument("--launcher", default="forkserver", choices=["forkserver", "spawn"],
                   help="multiprocessing start method of each point's process: forked from a server that has "
                        "imported torch and ssogvit (default; fast), or a new interpreter")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the points this many times, each in a fresh process, in rounds; each point keeps its "
                        "fastest time and lowest peak memory (default 1)")
    p.add_argument("--repeat-below-ms", type=float, default=None,
                   help="with --repeats, repeat only points whose first time is below this many ms")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a point is abandoned (default 1800)")
    p.add_argument("--out", default="bench-results", help="directory for JSON, CSV and PNG (default %(default)s)")
    p.add_argument("--name", default=None, help="file stem for the results (default: the sub-command)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--baseline", default=None,
                   help="mixer the ratios are taken against (default mha, else the first one listed)")


def _common(args: argparse.Namespace, device: str) -> dict[str, Any]:
    if args.iters < 0:
        raise UsageError(f"--iters expects 0 (memory only) or more calls per timed block, got {args.iters}")
    if args.iters == 0 and args.no_memory:
        raise UsageError("--iters 0 (no timing) with --no-memory measures nothing; drop one of them")
    return dict(
        warmup=args.warmup, iters=args.iters, blocks=args.blocks, device=device, dtype=_dtype(args.dtype, device),
        mode=args.mode, threads=args.threads, mem_cap_mib=args.mem_cap_mib, measure_memory=not args.no_memory,
        memory=args.memory, flush_denormal=args.flush_denormal,
    )


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="ssogvit bench", description="Efficiency benchmarks (docs/benchmarks.md).")
    sub = ap.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="throughput and peak memory of whole models over resolutions and batches")
    m.add_argument("--families", nargs="+", default=["vit", "looped", "ode"])
    m.add_argument("--sizes", nargs="+", default=["base"])
    m.add_argument("--mixers", nargs="+", default=None,
                   help="mixers of every family (default: mha ssog; the ode family adds mha-unfused, the explicit "
                        "attention that the paper benchmarks ODE-ViT with, and is compared with it first)")
    m.add_argument("--num-classes", type=int, default=1000)
    m.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="more create_model options (e.g. depth=2)")
    _add_run_options(m)

    o = sub.add_parser("operator", help="one mixer alone against attention at each resolution's token count")
    o.add_argument("--mixers", nargs="+", default=["torch-mha", "mha", "ssog"],
                   help="mixer names, options after a colon: ssog:impl=loop,num_atoms=4 (torch-mha: "
                        "torch.nn.MultiheadAttention)")
    o.add_argument("--impls", nargs="+", default=None,
                   help="run each SSoG mixer once per implementation ('all': every one in SSOG_IMPLS)")
    o.add_argument("--dim", type=int, default=768)
    o.add_argument("--heads", type=int, default=12)
    o.add_argument("--patch", type=int, default=16)
    o.add_argument("--prefix", type=int, default=1, help="prefix tokens (class, registers) in front of the patches")
    o.add_argument("--matmul-peak", action="store_true",
                   help="first measure a 2048^3 matmul's GFLOP/s (same threads and precision) and report each "
                        "mixer's rate as a fraction of it")
    _add_run_options(o)

    r = sub.add_parser("report", help="tables and plots again from saved results (several files are merged)")
    r.add_argument("files", nargs="+", help="results JSON files written by models or operator")
    r.add_argument("--out", default=None, help="directory for NAME.md, NAME.json and the PNGs (default: the first "
                                                "file's directory)")
    r.add_argument("--name", default=None, help="file stem (default: the first file's stem + '_report')")
    r.add_argument("--baseline", default=None)
    r.add_argument("--no-plots", action="store_true")

    t = sub.add_parser("check", help="SSoG against attention at ViT-B width (mixer alone, steered mixer, whole "
                                     "models, training steps, matmul peak), pass/fail against the thresholds given")
    t.add_argument("--models", nargs="+", default=["vit-base"], help="family-size stems of the whole-model points")
    t.add_argument("--model-batch", type=int, default=1, help="batch of the whole-model inference points")
    t.add_argument("--train-res", type=int, nargs="*", default=[], help="resolutions of the training steps (none)")
    t.add_argument("--train-batch", type=int, nargs="+", default=[1], help="batches of the training steps")
    t.add_argument("--from-json", default=None, metavar="RESULTS.json",
                   help="judge a saved run's results again instead of running anything")
    from ssogvit.bench.check import Thresholds

    for name in Thresholds.names():
        t.add_argument("--" + name.replace("_", "-"), type=float, default=None, metavar="X")
    _add_run_options(t)
    t.set_defaults(warmup=3, iters=10, res=list(RESOLUTIONS), out="bench-results")

    f = sub.add_parser("flops", help="forward GFLOPs per image, whole model and attention alone (paper Table 4)")
    f.add_argument("--families", nargs="+", default=["vit", "looped", "ode"])
    f.add_argument("--sizes", nargs="+", default=["base"])
    f.add_argument("--mixers", nargs="+", default=["mha", "ssog"])
    f.add_argument("--res", type=int, nargs="+", default=TABLE4_RESOLUTIONS)
    f.add_argument("--num-classes", type=int, default=1000)
    f.add_argument("--check", action="store_true", help="also count with torch's FlopCounterMode (runs a forward)")
    f.add_argument("--out", default=None, help="directory for flops.json / flops.csv")
    return ap


def _write_table(text: str, out: Path, name: str) -> None:
    print(text)
    (out / f"{name}.md").write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command_line = "ssogvit bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.command == "flops":
        return _flops(args)
    if args.command == "report":
        return _report(args)

    from ssogvit.bench.runner import machine_info, run_sweep, write_results

    device = _device(args.device)
    common = _common(args, device)
    name = args.name or args.command
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "check":
        return _check(args, device, common, name, out, command_line)
    if args.command == "models":
        from ssogvit.bench.model_sweep import model_points

        batches = args.batch or (GPU_BATCHES if device == "cuda" else CPU_MODEL_BATCHES)
        kwargs = {"num_classes": args.num_classes, **_kv(args.set)}
        points = model_points(args.families, args.sizes, args.mixers, resolutions=args.res, batches=batches,
                              model_kwargs=kwargs, **common)
    else:
        from ssogvit.bench.operator_sweep import expand_impls, operator_points

        mixers = expand_impls(args.mixers, args.impls, device)
        points = operator_points(mixers, dim=args.dim, heads=args.heads, resolutions=args.res,
                                 batches=args.batch or [8], patch=args.patch, prefix=args.prefix, **common)
        if args.matmul_peak:
            points.insert(0, dict(kind="matmul", label="matmul-2048", size=2048, res=None, tokens=None, batch=1,
                                  **{**common, "measure_memory": False}))
    meta = machine_info(device) | {"command": command_line, "points": len(points)}
    rows = run_sweep(points, out_dir=out, name=name, meta=meta, timeout=args.timeout, launcher=args.launcher,
                     repeats=args.repeats, repeat_below_ms=args.repeat_below_ms)
    meta["loadavg_end"] = machine_info(device)["loadavg"]
    key = "mixer" if args.command == "models" else "label"
    present = list(dict.fromkeys(str(p[key]) for p in points))
    baseline = args.baseline or ("mha" if "mha" in present or not present else present[0])
    write_results(rows, meta, out, name)

    print(f"# {command_line}\n# {meta['cpu']}, torch {meta['torch']}, {meta['torch_threads']} threads, device "
          f"{device}, load average {meta['loadavg']} -> {meta['loadavg_end']}\n")
    _render(args.command, rows, baseline, out, name, plots=not args.no_plots)
    failed = [r for r in rows if r.get("status") == "error"]
    for r in failed:
        print(f"error at {r.get('label')} res={r.get('res')} batch={r.get('batch')}: {r.get('error')}", file=sys.stderr)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.csv')}")
    return 1 if failed else 0


def _render(command: str, rows: list[dict], baseline: str, out: Path, name: str, *, plots: bool = True) -> None:
    from ssogvit.bench import plots as _plots

    if command == "models":
        from ssogvit.bench.model_sweep import format_model_table, format_saved_table

        saved = format_saved_table(rows)
        _write_table(format_model_table(rows, baseline) + (f"\n\nWhere the bytes go\n\n{saved}" if saved else ""),
                     out, name)
        if plots:
            for p in (_plots.plot_relative(rows, out / f"{name}_relative.png", baseline),
                      _plots.plot_models(rows, out / f"{name}_absolute.png")):
                if p:
                    print(f"wrote {p}")
    else:
        from ssogvit.bench.operator_sweep import format_fits, format_operator_table

        peak = next((r for r in rows if r.get("kind") == "matmul" and r.get("status") == "ok"), None)
        rows = [r for r in rows if r.get("kind") != "matmul"]
        text = format_operator_table(rows, baseline, peak and peak["achieved_gflops_per_s"])
        if peak:
            text = f"matmul peak (2048^3 torch.mm): {peak['achieved_gflops_per_s']:.1f} GFLOP/s\n\n" + text
        _write_table(text + "\n\n" + format_fits(rows), out, name)
        if plots:
            p = _plots.plot_operator(rows, out / f"{name}_fit.png")
            if p:
                print(f"wrote {p}")


def _read_mergeable(files: list[str]) -> tuple[list[dict], list[tuple[str, list[dict]]]]:
    """`(metas, [(file, rows)])` of results files that can share one table, or `UsageError` naming the one that cannot.

    Mergeable: results files of `bench models` or `bench operator` (not `bench flops` tables or `bench check` runs),
    all of one kind, measured on one machine (CPU, GPU and torch version alike), since their timings are compared
    side by side.
    """
    from ssogvit.bench.runner import read_results

    metas, parts = [], []
    for f in files:
        try:
            meta, rows = read_results(f)
        except FileNotFoundError:
            raise UsageError(f"{f} does not exist") from None
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{f} is not a results file of `ssogvit bench models` or `bench operator` (a `bench "
                             f"flops` file is a complete table already: see flops.md beside it)") from None
        metas.append(meta | {"file": str(f)})
        parts.append((str(f), rows))
    kinds = {(Path(f), frozenset({r.get("kind") for r in rows} - {"matmul"})) for f, rows in parts}
    if len({k for _, k in kinds}) != 1 or len(next(iter(kinds))[1]) != 1:
        found = ", ".join(f"{f.name}: {'/'.join(sorted(map(str, k))) or 'no rows'}" for f, k in sorted(kinds))
        raise UsageError(f"results of one kind (models or operator) can be merged, got {found}")
    machine = ("cpu", "gpu", "torch")
    first = metas[0]
    for m in metas[1:]:
        differs = [k for k in machine if m.get(k) != first.get(k)]
        if differs:
            k = differs[0]
            raise UsageError(f"{m['file']} was measured with {k} {m.get(k)!r} and {first['file']} with "
                             f"{first.get(k)!r}: timings of different machines cannot share one table")
    return metas, parts


def _report(args: argparse.Namespace) -> int:
    from ssogvit.bench.runner import write_results

    metas, parts = _read_mergeable(args.files)
    rows = [r for _, part in parts for r in part]
    command = "models" if {r.get("kind") for r in rows} - {"matmul"} == {"model"} else "operator"
    first = Path(args.files[0])
    out = Path(args.out) if args.out else first.parent
    name = args.name or first.stem + "_report"
    out.mkdir(parents=True, exist_ok=True)
    # Rule for a point measured in several files: the file given last on the command line wins (said below).
    keyed: dict[tuple, tuple[str, dict]] = {}
    seen_in: dict[tuple, list[str]] = {}
    for f, part in parts:
        for r in part:
            key = (r.get("kind"), r.get("label"), r.get("res"), r.get("batch"), r.get("mode"), r.get("dtype"),
                   r.get("device"), r.get("threads"))
            keyed[key] = (f, r)
            seen_in.setdefault(key, []).append(Path(f).name)
    rows = [r for _, r in keyed.values()]
    key = "mixer" if command == "models" else "label"
    present = list(dict.fromkeys(str(r.get(key)) for r in rows))
    baseline = args.baseline or ("mha" if "mha" in present or not present else present[0])
    repeated = {k: files for k, files in seen_in.items() if len(files) > 1}
    rule = "a point measured in several files is taken from the file given last on the command line"
    write_results(rows, {"merged_from": metas, "merge_rule": rule, "points_in_several_files": len(repeated)}, out,
                  name)
    for m in metas:
        print(f"# {m.get('file')}: {m.get('command')} ({m.get('date_utc')}, load average {m.get('loadavg')} -> "
              f"{m.get('loadavg_end')})")
    if repeated:
        shown = "; ".join(f"{k[1]} res={k[2]} batch={k[3]}: {', '.join(files)} -> {files[-1]}"
                          for k, files in list(repeated.items())[:3])
        print(f"# {len(repeated)} point(s) measured in several files; {rule} ({shown}"
              f"{'; ...' if len(repeated) > 3 else ''})")
    _render(command, rows, baseline, out, name, plots=not args.no_plots)
    return 0


def _flops(args: argparse.Namespace) -> int:
    from ssogvit.bench.flops import flops_rows, format_flops_table

    names = [f"{fam}-{size}-{mixer}" for fam in args.families for size in args.sizes for mixer in args.mixers]
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.check else None  # the check takes minutes
    rows = flops_rows(names, args.res, check=args.check, model_kwargs={"num_classes": args.num_classes}, log=log)
    text = format_flops_table(rows)
    print(text)
    if args.out:
        import csv

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "flops.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "flops.md").write_text(text + "\n")
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with (out / "flops.csv").open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    return 0


def _check(args: argparse.Namespace, device: str, common: dict[str, Any], name: str, out: Path,
           command_line: str) -> int:
    from ssogvit.bench.check import Thresholds, check_points, evaluate, format_check
    from ssogvit.bench.runner import machine_info, read_results, run_sweep, write_results

    limits = Thresholds(**{k: getattr(args, k) for k in Thresholds.names()})
    if args.from_json:
        try:
            meta, rows = read_results(args.from_json)
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"{args.from_json} is not a results file of `ssogvit bench check`") from None
        meta = {"loadavg_end": meta.get("loadavg")} | meta | {"command": command_line}
    else:
        points = check_points(resolutions=args.res, batches=args.batch or [1, 8], models=args.models,
                              model_batch=args.model_batch, train_resolutions=args.train_res,
                              train_batches=args.train_batch, **common)
        meta = machine_info(device) | {"command": command_line, "points": len(points), "repeats": args.repeats,
                                       "repeat_below_ms": args.repeat_below_ms}
        rows = run_sweep(points, out_dir=out, name=name, meta=meta, timeout=args.timeout, launcher=args.launcher,
                         repeats=args.repeats, repeat_below_ms=args.repeat_below_ms)
        meta["loadavg_end"] = machine_info(device)["loadavg"]
        write_results(rows, meta, out, name)
    checks = evaluate(rows, limits)
    (out / f"{name}_checks.json").write_text(json.dumps(checks, indent=1) + "\n")
    header = (f"# {meta['command']}\n# {meta.get('cpu')}, torch {meta.get('torch')}, {meta.get('torch_threads')} "
              f"threads, device {device}, load average {meta.get('loadavg')} -> {meta.get('loadavg_end')}, ssogvit "
              f"{meta.get('ssogvit_commit', '?')}{' (modified)' if meta.get('ssogvit_dirty') else ''}\n")
    if meta.get("repeats", 1) > 1:
        below = f" whose first time was below {meta['repeat_below_ms']:g} ms" if meta.get("repeat_below_ms") else ""
        header += (f"# each point ran in {meta['repeats']} fresh processes{below}; it keeps its fastest time and its "
                   "lowest peak memory\n")
    _write_table(header + "\n" + format_check(checks), out, f"{name}_table")
    met, missed = sum(r["met"] is True for r in checks), sum(r["met"] is False for r in checks)
    print(f"\n{met} checks passed, {missed} failed; wrote {out / (name + '_table.md')}")
    return 1 if missed else 0
