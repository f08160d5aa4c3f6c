"""``ssogvit bench models|operator|flops|check|report``: the efficiency benchmarks of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import csv
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


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of every sweep; docs/benchmarks.md has the table of what each means."""
    add = p.add_argument
    add("--res", type=int, nargs="+", default=RESOLUTIONS, help="image resolutions (default %(default)s)")
    add("--batch", type=int, nargs="+", default=None, help="batch sizes (default: models 8..512 on CUDA, 1 4 on CPU; "
                                                            "operator 8)")
    add("--warmup", type=int, default=10, help="warm-up calls (default 10)")
    add("--iters", type=int, default=50, help="calls per timed block (default 50; 0: no timing, memory only)")
    add("--blocks", type=int, default=3, help="timed blocks per point; the fastest is kept (default 3)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="autocast precision (default: fp16 "
                                                                                  "on CUDA, fp32 on CPU)")
    add("--mode", default="inference", choices=["inference", "train"],
        help="inference (torch.inference_mode) or a training step (forward, backward, AdamW step)")
    add("--threads", type=int, default=None, help="torch threads in each point's process")
    add("--mem-cap-mib", type=float, default=None, help="memory cap per point (CPU: address space, RLIMIT_AS; CUDA: a "
                                                        "memory fraction); a point over it is out of memory")
    add("--no-memory", action="store_true", help="skip the peak-memory call")
    add("--memory", default="allocator", choices=["allocator", "resident", "both"],
        help="CPU peak memory: PyTorch's allocator (default), the resident set, or both")
    add("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) in each point")
    add("--launcher", default="forkserver", choices=["forkserver", "spawn"],
        help="each point's process: forked from a server that imported torch and ssogvit (default), or a new one")
    add("--repeats", type=int, default=1, help="rounds of fresh processes; each point keeps its fastest time and "
                                               "lowest peak memory (default 1)")
    add("--repeat-below-ms", type=float, default=None, help="repeat only points whose first time is below this")
    add("--timeout", type=float, default=1800, help="seconds before a point is abandoned (default 1800)")
    add("--out", default="bench-results", help="directory for JSON, CSV and PNG (default %(default)s)")
    add("--name", default=None, help="file stem for the results (default: the sub-command)")
    add("--no-plots", action="store_true")
    add("--baseline", default=None, help="mixer the ratios are taken against (default mha, else the first listed)")


def _parser() -> argparse.ArgumentParser:
    from ssogvit.bench.check import Thresholds

    ap = ArgumentParser(prog="ssogvit bench", description="Efficiency benchmarks (docs/benchmarks.md).")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("models", help="throughput and peak memory of whole models over resolutions and batches")
    f = sub.add_parser("flops", help="forward GFLOPs per image, whole model and attention alone (paper Table 4)")
    for p in (m, f):
        p.add_argument("--families", nargs="+", default=["vit", "looped", "ode"])
        p.add_argument("--sizes", nargs="+", default=["base"])
        p.add_argument("--num-classes", type=int, default=1000)
    m.add_argument("--mixers", nargs="+", default=None, help="mixers of every family (default: mha ssog, and "
                   "mha-unfused first for the ode family: the explicit attention the paper benchmarks ODE-ViT with)")
    m.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="more create_model options (e.g. depth=2)")
    _add_run_options(m)
    f.add_argument("--mixers", nargs="+", default=["mha", "ssog"])
    f.add_argument("--res", type=int, nargs="+", default=TABLE4_RESOLUTIONS)
    f.add_argument("--check", action="store_true", help="also count with torch's FlopCounterMode (runs a forward)")
    f.add_argument("--out", default=None, help="directory for flops.json / flops.csv")
    o = sub.add_parser("operator", help="one mixer alone against attention at each resolution's token count")
    o.add_argument("--mixers", nargs="+", default=["torch-mha", "mha", "ssog"], help="registered mixer names, "
                   "options after a colon (ssog:impl=loop,num_atoms=4), torch-mha: torch.nn.MultiheadAttention")
    o.add_argument("--impls", nargs="+", default=None, help="each SSoG mixer once per implementation ('all')")
    o.add_argument("--dim", type=int, default=768)
    o.add_argument("--heads", type=int, default=12)
    o.add_argument("--patch", type=int, default=16)
    o.add_argument("--prefix", type=int, default=1, help="prefix tokens (class, registers) in front of the patches")
    o.add_argument("--matmul-peak", action="store_true", help="first measure a 2048^3 matmul's GFLOP/s and report "
                                                              "each mixer's rate as a fraction of it")
    _add_run_options(o)
    r = sub.add_parser("report", help="tables and plots again from saved results (several files are merged)")
    r.add_argument("files", nargs="+", help="results JSON files written by models or operator")
    r.add_argument("--out", default=None, help="directory for the outputs (default: the first file's directory)")
    r.add_argument("--name", default=None, help="file stem (default: the first file's stem + '_report')")
    r.add_argument("--baseline", default=None)
    r.add_argument("--no-plots", action="store_true")
    t = sub.add_parser("check", help="SSoG against attention at ViT-B width, pass/fail against the thresholds given")
    t.add_argument("--models", nargs="+", default=["vit-base"], help="family-size stems of the whole-model points")
    t.add_argument("--model-batch", type=int, default=1, help="batch of the whole-model inference points")
    t.add_argument("--train-res", type=int, nargs="*", default=[], help="resolutions of the training steps (none)")
    t.add_argument("--train-batch", type=int, nargs="+", default=[1], help="batches of the training steps")
    t.add_argument("--from-json", default=None, metavar="RESULTS.json", help="judge a saved run's results again")
    for name in Thresholds.names():
        t.add_argument("--" + name.replace("_", "-"), type=float, default=None, metavar="X")
    _add_run_options(t)
    t.set_defaults(warmup=3, iters=10, res=list(RESOLUTIONS), out="bench-results")
    return ap


def _common(args: argparse.Namespace) -> dict[str, Any]:
    """What every point of a sweep shares, from the run options."""
    import torch

    if args.iters < 0:
        raise UsageError(f"--iters expects 0 (memory only) or more calls per timed block, got {args.iters}")
    if args.iters == 0 and args.no_memory:
        raise UsageError("--iters 0 (no timing) with --no-memory measures nothing; drop one of them")
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else "fp16" if device == "cuda" else "fp32"
    return dict(warmup=args.warmup, iters=args.iters, blocks=args.blocks, device=device, dtype=dtype, mode=args.mode,
                threads=args.threads, mem_cap_mib=args.mem_cap_mib, measure_memory=not args.no_memory,
                memory=args.memory, flush_denormal=args.flush_denormal)


def _write_table(text: str, out: Path, name: str) -> None:
    print(text)
    (out / f"{name}.md").write_text(text + "\n")


def _baseline(rows: list[dict], key: str, asked: str | None) -> str:
    present = list(dict.fromkeys(str(r.get(key)) for r in rows))
    return asked or ("mha" if "mha" in present or not present else present[0])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command_line = "ssogvit bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.command == "flops":
        return _flops(args)
    if args.command == "report":
        return _report(args)
    from ssogvit.bench.runner import machine_info, run_sweep, write_results
    from ssogvit.bench.sweeps import expand_impls, model_points, operator_points, parse_value

    common = _common(args)
    name, out = args.name or args.command, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "check":
        return _check(args, common, name, out, command_line)
    if args.command == "models":
        sets = [item.partition("=") for item in args.set or []]
        if any(not eq for _, eq, _ in sets):
            raise UsageError(f"--set expects key=value, got {next(k for k, eq, _ in sets if not eq)!r}")
        batches = args.batch or (GPU_BATCHES if common["device"] == "cuda" else CPU_MODEL_BATCHES)
        points = model_points(args.families, args.sizes, args.mixers, resolutions=args.res, batches=batches,
                              model_kwargs={"num_classes": args.num_classes, **{k: parse_value(v) for k, _, v in sets}},
                              **common)
    else:
        points = operator_points(expand_impls(args.mixers, args.impls, common["device"]), dim=args.dim,
                                 heads=args.heads, resolutions=args.res, batches=args.batch or [8], patch=args.patch,
                                 prefix=args.prefix, **common)
        if args.matmul_peak:
            points.insert(0, dict(kind="matmul", label="matmul-2048", size=2048, res=None, tokens=None, batch=1,
                                  **{**common, "measure_memory": False}))
    meta = machine_info(common["device"]) | {"command": command_line, "points": len(points)}
    rows = run_sweep(points, out_dir=out, name=name, meta=meta, timeout=args.timeout, launcher=args.launcher,
                     repeats=args.repeats, repeat_below_ms=args.repeat_below_ms)
    meta["loadavg_end"] = machine_info(common["device"])["loadavg"]
    write_results(rows, meta, out, name)
    print(f"# {command_line}\n# {meta['cpu']}, torch {meta['torch']}, {meta['torch_threads']} threads, device "
          f"{common['device']}, load average {meta['loadavg']} -> {meta['loadavg_end']}\n")
    baseline = _baseline([p for p in points if p["kind"] != "matmul"],
                         "mixer" if args.command == "models" else "label", args.baseline)
    _render(args.command, rows, baseline, out, name, plots=not args.no_plots)
    failed = [r for r in rows if r.get("status") == "error"]
    for r in failed:
        print(f"error at {r.get('label')} res={r.get('res')} batch={r.get('batch')}: {r.get('error')}", file=sys.stderr)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.csv')}")
    return 1 if failed else 0


def _render(command: str, rows: list[dict], baseline: str, out: Path, name: str, *, plots: bool = True) -> None:
    """The tables (printed and ``NAME.md``) and plots of a sweep's rows."""
    from ssogvit.bench import plots as figures
    from ssogvit.bench.sweeps import format_fits, format_model_table, format_operator_table, format_saved_table

    if command == "models":
        saved = format_saved_table(rows)
        _write_table(format_model_table(rows, baseline) + (f"\nWhere the bytes go\n\n{saved}" if saved else ""), out,
                     name)
        drawn = [figures.plot_relative(rows, out / f"{name}_relative.png", baseline),
                 figures.plot_models(rows, out / f"{name}_absolute.png")] if plots else []
    else:
        peak = next((r for r in rows if r.get("kind") == "matmul" and r.get("status") == "ok"), None)
        rows = [r for r in rows if r.get("kind") != "matmul"]
        text = format_operator_table(rows, baseline, peak and peak["achieved_gflops_per_s"])
        if peak:
            text = f"matmul peak (2048^3 torch.mm): {peak['achieved_gflops_per_s']:.1f} GFLOP/s\n\n" + text
        _write_table(text + "\n" + format_fits(rows), out, name)
        drawn = [figures.plot_operator(rows, out / f"{name}_fit.png")] if plots else []
    for p in filter(None, drawn):
        print(f"wrote {p}")


def _report(args: argparse.Namespace) -> int:
    """Tables and plots again from saved results files of one kind and one machine, merged: a point measured in
    several files is taken from the one given last."""
    from ssogvit.bench.runner import read_results, write_results

    metas, parts = [], []
    for f in args.files:
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
    for m in metas[1:]:  # timings of different machines never share a table
        for k in ("cpu", "gpu", "torch"):
            if m.get(k) != metas[0].get(k):
                raise UsageError(f"{m['file']} was measured with {k} {m.get(k)!r} and {metas[0]['file']} with "
                                 f"{metas[0].get(k)!r}: timings of different machines cannot share one table")
    keyed: dict[tuple, dict] = {}
    seen_in: dict[tuple, list[str]] = {}
    for f, part in parts:
        for r in part:
            key = tuple(r.get(k) for k in ("kind", "label", "res", "batch", "mode", "dtype", "device", "threads"))
            keyed[key] = r
            seen_in.setdefault(key, []).append(Path(f).name)
    rows = list(keyed.values())
    command = "models" if {r.get("kind") for r in rows} - {"matmul"} == {"model"} else "operator"
    first = Path(args.files[0])
    out, name = Path(args.out) if args.out else first.parent, args.name or first.stem + "_report"
    out.mkdir(parents=True, exist_ok=True)
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
    rows_of_kind = [r for r in rows if r.get("kind") != "matmul"]
    _render(command, rows, _baseline(rows_of_kind, "mixer" if command == "models" else "label", args.baseline), out,
            name, plots=not args.no_plots)
    return 0


def _flops(args: argparse.Namespace) -> int:
    from ssogvit.bench.flops import flops_rows, format_flops_table

    names = [f"{fam}-{size}-{mixer}" for fam in args.families for size in args.sizes for mixer in args.mixers]
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.check else None  # the check takes minutes
    rows = flops_rows(names, args.res, check=args.check, model_kwargs={"num_classes": args.num_classes}, log=log)
    text = format_flops_table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "flops.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "flops.md").write_text(text + "\n")
        with (out / "flops.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def _check(args: argparse.Namespace, common: dict[str, Any], name: str, out: Path, command_line: str) -> int:
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
        meta = machine_info(common["device"]) | {"command": command_line, "points": len(points),
                                                 "repeats": args.repeats, "repeat_below_ms": args.repeat_below_ms}
        rows = run_sweep(points, out_dir=out, name=name, meta=meta, timeout=args.timeout, launcher=args.launcher,
                         repeats=args.repeats, repeat_below_ms=args.repeat_below_ms)
        meta["loadavg_end"] = machine_info(common["device"])["loadavg"]
        write_results(rows, meta, out, name)
    checks = evaluate(rows, limits)
    (out / f"{name}_checks.json").write_text(json.dumps(checks, indent=1) + "\n")
    header = (f"# {meta['command']}\n# {meta.get('cpu')}, torch {meta.get('torch')}, {meta.get('torch_threads')} "
              f"threads, device {common['device']}, load average {meta.get('loadavg')} -> {meta.get('loadavg_end')}, "
              f"ssogvit {meta.get('ssogvit_commit', '?')}{' (modified)' if meta.get('ssogvit_dirty') else ''}\n")
    if meta.get("repeats", 1) > 1:
        below = f" whose first time was below {meta['repeat_below_ms']:g} ms" if meta.get("repeat_below_ms") else ""
        header += (f"# each point ran in {meta['repeats']} fresh processes{below}; it keeps its fastest time and its "
                   "lowest peak memory\n")
    _write_table(header + "\n" + format_check(checks), out, f"{name}_table")
    met, missed = sum(r["met"] is True for r in checks), sum(r["met"] is False for r in checks)
    print(f"\n{met} checks passed, {missed} failed; wrote {out / (name + '_table.md')}")
    return 1 if missed else 0
