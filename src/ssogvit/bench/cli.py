"""``ssogvit bench models|operator|flops|check|report`` (docs/benchmarks.md). Arguments are declared
(``ssogvit.specs``); a run's files are checked before any work, never replaced without ``--overwrite``, and written
atomically after every point (``ssogvit.outputs``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from ssogvit.bench import sweeps
from ssogvit.bench.check import RESOLUTIONS, Thresholds, check_points, evaluate, format_check
from ssogvit.bench.flops import TABLE4_ATTENTION, TABLE4_TOTAL, flops_breakdown, grid_of, measure_flops
from ssogvit.bench.point import build
from ssogvit.bench.runner import csv_text, machine_info, read_results, run_sweep, write_results
from ssogvit.bench.sweeps import cell
from ssogvit.errors import ArgumentParser, UsageError
from ssogvit.documents import input_file
from ssogvit.specs import BATCH_SIZE, EMBED_DIM, IMG_SIZE, NUM_CLASSES, NUM_HEADS, PATCH_SIZE, Float, Int
from ssogvit.layers import list_mixers
from ssogvit.models import FAMILIES, SIZES, create_model
from ssogvit.outputs import check_output_file, check_output_folder, write_text
from ssogvit.results import markdown_table

GPU_BATCHES, CPU_MODEL_BATCHES = [8, 16, 32, 64, 128, 256, 512], [1, 4]
COUNT, POSITIVE, POSITIVE_NUMBER = Int(0), Int(1), Float(0, low_open=True)


def _add_run_options(p: argparse.ArgumentParser) -> None:  # docs/benchmarks.md has the table of what each means
    add = p.add_argument
    add("--res", type=IMG_SIZE.argparse, nargs="+", default=list(RESOLUTIONS), help="image resolutions")
    add("--batch", type=BATCH_SIZE.argparse, nargs="+", help="batch sizes (default: models 1 4 on CPU; operator 8)")
    add("--warmup", type=COUNT.argparse, default=10, help="warm-up calls")
    add("--iters", type=COUNT.argparse, default=50, help="calls per timed block (0: memory only)")
    add("--blocks", type=POSITIVE.argparse, default=3, help="timed blocks per point; the fastest is kept")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="autocast (auto: fp16 on CUDA)")
    add("--mode", nargs="+", default=["inference"], choices=["inference", "train"],
        help="train: forward, backward, AdamW step; both: every point in each mode, side by side in one run")
    add("--threads", type=Int(1, 1024).argparse, help="torch threads in each point's process")
    add("--mem-cap-mib", type=POSITIVE_NUMBER.argparse, help="memory cap per point (out of memory beyond it)")
    add("--no-memory", action="store_true", help="skip the peak-memory call")
    add("--memory", default="allocator", choices=["allocator", "resident", "both"], help="CPU peak memory measure")
    add("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) in each point")
    add("--compile", action="store_true", help="torch.compile each point's forward (the first warm-up call: compile_s)")
    add("--launcher", default="forkserver", choices=["forkserver", "spawn"], help="how a point's process starts")
    add("--repeats", type=POSITIVE.argparse, default=1, help="rounds of fresh processes; each point keeps its best")
    add("--repeat-below-ms", type=POSITIVE_NUMBER.argparse, help="repeat only points first timed below this")
    add("--timeout", type=POSITIVE_NUMBER.argparse, default=1800, help="seconds before a point is abandoned")
    _add_output_options(p, "bench-results")


def _add_output_options(p: argparse.ArgumentParser, out: str | None) -> None:
    p.add_argument("--out", default=out, help="directory of the results" + (f" (default {out})" if out else ""))
    p.add_argument("--name", help="file stem of the results (default: the sub-command)")
    p.add_argument("--overwrite", action="store_true", help="replace results a run of the same name wrote")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--baseline", help="mixer the ratios are taken against (default mha, else the first)")


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="ssogvit bench", description="Efficiency benchmarks (docs/benchmarks.md).")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("models", help="throughput and peak memory of whole models over resolutions and batches")
    f = sub.add_parser("flops", help="forward GFLOPs per image, whole model and attention alone (paper Table 4)")
    for p in (m, f):
        p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
        p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["base"])
        p.add_argument("--num-classes", type=NUM_CLASSES.argparse, default=1000)
    m.add_argument("--mixers", nargs="+", choices=list_mixers(), default=None, help="mixers of every family "
                   "(default: mha ssog, and first mha-unfused for ode, as the paper benchmarks ODE-ViT)")
    m.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="more create_model options (e.g. depth=2)")
    _add_run_options(m)
    f.add_argument("--mixers", nargs="+", choices=list_mixers(), default=["mha", "ssog"])
    f.add_argument("--res", type=IMG_SIZE.argparse, nargs="+", default=list(TABLE4_TOTAL["mha"]))  # the paper's Table 4
    f.add_argument("--check", action="store_true", help="also count with torch's FlopCounterMode (runs a forward)")
    f.add_argument("--out", default=None, help="directory for flops.json / flops.md / flops.csv")
    f.add_argument("--overwrite", action="store_true", help="replace the flops files there")
    o = sub.add_parser("operator", help="one mixer alone against attention at each resolution's token count")
    o.add_argument("--mixers", nargs="+", default=["torch-mha", "mha", "ssog"], help="registered mixer names, "
                   "options after a colon (ssog:impl=einsum,num_atoms=4), torch-mha: torch.nn.MultiheadAttention")
    o.add_argument("--impls", nargs="+", default=None, help="each SSoG mixer once per implementation ('all')")
    o.add_argument("--dim", type=EMBED_DIM.argparse, default=768)
    o.add_argument("--heads", type=NUM_HEADS.argparse, default=12)
    o.add_argument("--patch", type=PATCH_SIZE.argparse, default=16)
    o.add_argument("--prefix", type=Int(0, 1024).argparse, default=1, help="prefix tokens in front of the patches")
    o.add_argument("--matmul-peak", action="store_true", help="first measure a 2048^3 matmul's GFLOP/s and report "
                                                              "each mixer's rate as a fraction of it")
    _add_run_options(o)
    r = sub.add_parser("report", help="tables and plots again from saved results (several files are merged)")
    r.add_argument("files", nargs="+", help="results JSON files written by models or operator")
    _add_output_options(r, None)
    t = sub.add_parser("check", help="SSoG against attention at ViT-B width, pass/fail against the thresholds given")
    t.add_argument("--models", nargs="+", default=["vit-base"], help="family-size stems of the whole-model points")
    t.add_argument("--model-batch", type=BATCH_SIZE.argparse, default=1, help="batch of the whole-model points")
    t.add_argument("--train-res", type=IMG_SIZE.argparse, nargs="*", default=[], help="resolutions of training steps")
    t.add_argument("--train-batch", type=BATCH_SIZE.argparse, nargs="+", default=[1], help="batches of training steps")
    t.add_argument("--from-json", default=None, metavar="RESULTS.json", help="judge a saved run's results again")
    for field in fields(Thresholds):
        t.add_argument("--" + field.name.replace("_", "-"), type=Float(0).argparse, default=None, metavar="X")
    _add_run_options(t)
    t.set_defaults(warmup=3, iters=10)
    return ap


def _claim(out: str | Path, files: list[str], overwrite: bool) -> Path:
    """The output folder, created once none of ``files`` there exists (unless ``overwrite``): checked before work."""
    folder = check_output_folder(out, "--out")
    for name in files if folder.exists() else []:
        check_output_file(folder / name, "--out", overwrite=overwrite)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _outputs(command: str, name: str, plots: bool) -> list[str]:
    figures = {"models": ["_relative.png", "_absolute.png"], "operator": ["_fit.png"]}.get(command, []) if plots else []
    return [name + s for s in [".json", ".csv", ".md", *figures]]


def _header(meta: dict, device: str) -> str:  # where a run was measured, and (`bench check`) how often
    text = (f"# {meta['command']}\n# {meta.get('cpu')}, torch {meta.get('torch')}, {meta.get('torch_threads')} "
            f"threads, device {device}, load average {meta.get('loadavg')} -> {meta.get('loadavg_end')}, ssogvit "
            f"{meta.get('ssogvit_commit', '?')}{' (modified)' if meta.get('ssogvit_dirty') else ''}\n")
    if meta.get("repeats", 1) > 1:
        below = f" whose first time was below {meta['repeat_below_ms']:g} ms" if meta.get("repeat_below_ms") else ""
        text += (f"# each point ran in {meta['repeats']} fresh processes{below}; it keeps its fastest time and its "
                 "lowest peak memory\n")
    return text


def _sweep(points: list[dict], args: argparse.Namespace, common: dict[str, Any], out: Path, name: str,
           command_line: str, **meta: Any) -> tuple[list[dict], dict]:
    meta = machine_info(common["device"]) | {"command": command_line, "points": len(points)} | meta
    rows = run_sweep(points, out_dir=out, name=name, meta=meta, timeout=args.timeout, launcher=args.launcher,
                     repeats=args.repeats, repeat_below_ms=args.repeat_below_ms)
    meta["loadavg_end"] = machine_info(common["device"])["loadavg"]
    write_results(rows, meta, out, name)
    return rows, meta


def _write_table(text: str, out: Path, name: str) -> None:
    print(text)
    write_text(out / f"{name}.md", text + "\n", overwrite=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command_line = "ssogvit bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.command in ("flops", "report"):
        return _flops(args) if args.command == "flops" else _report(args)
    if args.iters == 0 and args.no_memory:
        raise UsageError("--iters 0 (no timing) with --no-memory measures nothing; drop one of them")
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else "fp16" if device == "cuda" else "fp32"
    common = dict(warmup=args.warmup, iters=args.iters, blocks=args.blocks, device=device, dtype=dtype,
                  mode=args.mode[0], threads=args.threads, mem_cap_mib=args.mem_cap_mib,
                  measure_memory=not args.no_memory, memory=args.memory, flush_denormal=args.flush_denormal,
                  compile=args.compile)  # what every point shares
    name = args.name or args.command
    if args.command == "check":
        return _check(args, common, name, command_line)
    if args.command == "models":
        sets = [item.partition("=") for item in args.set or []]
        if bad := [key for key, eq, _ in sets if not eq]:
            raise UsageError(f"--set expects key=value, got {bad[0]!r}")
        kwargs = {"num_classes": args.num_classes, **{k: sweeps.parse_value(v) for k, _, v in sets}}
        points = sweeps.model_points(args.families, args.sizes, args.mixers, resolutions=args.res, model_kwargs=kwargs,
                                     batches=args.batch or (GPU_BATCHES if device == "cuda" else CPU_MODEL_BATCHES),
                                     **common)
    else:
        known = [*list_mixers(), "torch-mha"]
        if unknown := [m for m in args.mixers if sweeps.parse_mixer(m)[0] not in known]:
            raise UsageError(f"unknown mixer {unknown[0]!r}; expected one of {known}")
        if uneven := [r for r in args.res if r % args.patch]:  # a grid of res // patch would be labelled res
            r, g = uneven[0], uneven[0] // args.patch
            raise UsageError(f"--res {r} is not a multiple of --patch {args.patch}: the mixer would run on a {g}x{g} "
                             f"grid ({g * args.patch} px) labelled {r}; give resolutions the patch divides")
        points = sweeps.operator_points(sweeps.expand_impls(args.mixers, args.impls, device), dim=args.dim,
                                        heads=args.heads, resolutions=args.res, batches=args.batch or [8],
                                        patch=args.patch, prefix=args.prefix, **common)
        if args.matmul_peak:
            points.insert(0, dict(kind="matmul", label="matmul-2048", size=2048, res=None, tokens=None, batch=1,
                                  **{**common, "measure_memory": False}))
    # each configuration built once on the meta device: an option it refuses is a usage error, not a failed point
    builds = {}  # the first point of each configuration (a label: all a run's points of one model share its options)
    for p in (p for p in points if p["kind"] != "matmul" and p["mixer"] != "torch-mha"):
        builds.setdefault(p["label"], p)
    for p in builds.values():
        try:
            with torch.device("meta"):
                build(p, torch.device("meta"))
        except (ValueError, TypeError) as err:
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise UsageError(f"{p['label']} does not build: {first}") from None
    points = [p | {"mode": mode} for mode in dict.fromkeys(args.mode) for p in points
              if p["kind"] != "matmul" or mode == args.mode[0]]
    out = _claim(args.out, _outputs(args.command, name, not args.no_plots), args.overwrite)
    rows, meta = _sweep(points, args, common, out, name, command_line)
    print(_header(meta, device))
    _render(args.command, rows, args.baseline, out, name, plots=not args.no_plots)
    failed = [r for r in rows if r.get("status") == "error"]
    for r in failed:
        print(f"error at {r.get('label')} res={r.get('res')} batch={r.get('batch')}: {r.get('error')}", file=sys.stderr)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.csv')}")
    return 1 if failed else 0


def _render(command: str, rows: list[dict], baseline: str | None, out: Path, name: str, *, plots: bool) -> None:
    """The tables (printed and ``NAME.md``) and plots of a sweep's rows; ``baseline``: default mha, else the first."""
    present = [str(r.get("mixer" if command == "models" else "label")) for r in rows if r.get("kind") != "matmul"]
    baseline = baseline or ("mha" if "mha" in present or not present else present[0])
    if command == "models":
        _write_table(sweeps.format_model_table(rows, baseline) + sweeps.format_saved_table(rows), out, name)
        drawn = [sweeps.plot_relative(rows, out / f"{name}_relative.png", baseline),
                 sweeps.plot_models(rows, out / f"{name}_absolute.png")] if plots else []
    else:
        peak = next((r for r in rows if r.get("kind") == "matmul" and r.get("status") == "ok"), {})
        rows = [r for r in rows if r.get("kind") != "matmul"]
        text = sweeps.format_operator_table(rows, baseline, peak.get("achieved_gflops_per_s"))
        _write_table(text + "\n" + sweeps.format_fits(rows), out, name)
        drawn = [sweeps.plot_operator(rows, out / f"{name}_fit.png")] if plots else []
    for p in filter(None, drawn):
        print(f"wrote {p}")


def _report(args: argparse.Namespace) -> int:
    """Tables and plots again from results files of one kind and one machine, merged by the ``rule`` below."""
    metas, kinds, merged, seen = [], {}, {}, {}  # merged: a point's key -> its row; seen: -> the files that have it
    for f in args.files:
        path = input_file(f, "FILES")
        try:
            meta, rows = read_results(path)
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{f} is not a results file of `ssogvit bench models` or `bench operator` (a `bench "
                             "flops` file is a complete table already: see flops.md beside it)") from None
        metas.append(meta | {"file": str(f)})
        kinds[Path(f)] = frozenset({r.get("kind") for r in rows} - {"matmul"})
        for r in rows:  # a later file's row replaces an earlier one's, in the place of the first
            key = tuple(r.get(k) for k in ("kind", "label", "res", "batch", "mode", "dtype", "device", "threads"))
            merged[key] = r
            seen.setdefault(key, []).append(path.name)
    if len(set(kinds.values())) != 1 or len(next(iter(kinds.values()))) != 1:
        found = ", ".join(f"{f.name}: {'/'.join(sorted(map(str, k))) or 'no rows'}" for f, k in sorted(kinds.items()))
        raise UsageError(f"results of one kind (models or operator) can be merged, got {found}")
    for m, k in ((m, k) for m in metas[1:] for k in ("cpu", "gpu", "torch") if m.get(k) != metas[0].get(k)):
        raise UsageError(f"{m['file']} was measured with {k} {m.get(k)!r} and {metas[0]['file']} with "
                         f"{metas[0].get(k)!r}: timings of different machines cannot share one table")
    command = "models" if next(iter(kinds.values())) == {"model"} else "operator"
    rows, first = list(merged.values()), Path(args.files[0])
    name = args.name or first.stem + "_report"
    out = _claim(args.out or first.parent, _outputs(command, name, not args.no_plots), args.overwrite)
    repeated = {k: files for k, files in seen.items() if len(files) > 1}
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
    _render(command, rows, args.baseline, out, name, plots=not args.no_plots)
    return 0


def _flops(args: argparse.Namespace) -> int:
    """GFLOPs per image, analytic (``--check``: also ``FlopCounterMode``), beside the paper's (D 768, depth 12)."""
    out = _claim(args.out, ["flops.json", "flops.md", "flops.csv"], args.overwrite) if args.out else None
    names = [f"{fam}-{size}-{mixer}" for fam in args.families for size in args.sizes for mixer in args.mixers]
    rows = []
    for name in names:
        model = None
        for res in args.res:
            if model is None or args.check:  # the check runs a forward at each resolution's own position embedding
                model = create_model(name, img_size=res, num_classes=args.num_classes).eval()
            parts, (gh, gw) = flops_breakdown(model, res), grid_of(model, res)
            row = {"model": name, "res": res, "tokens": model.num_prefix_tokens + gh * gw,
                   "gflops": parts["total"] / 1e9, "attention_gflops": parts["mixer"] / 1e9,
                   "attention_read_gflops": (parts["mixer"] - parts["mixer_core"] + parts["mixer_core_read"]) / 1e9,
                   "mlp_gflops": parts["mlp"] / 1e9, "patch_embed_gflops": parts["patch_embed"] / 1e9}
            paper = "mha" if model.mixer_name.startswith("mha") else model.mixer_name
            if (model.embed_dim, model.depth) == (768, 12):
                row["paper_gflops"] = TABLE4_TOTAL.get(paper, {}).get(res)
                row["paper_attention_gflops"] = TABLE4_ATTENTION.get(paper, {}).get(res)
            if args.check:  # it takes minutes: a line per point
                row["measured_gflops"] = measure_flops(model, res) / 1e9
                print(f"[{len(rows) + 1}/{len(names) * len(args.res)}] {name} res={res}: analytic {row['gflops']:.2f}"
                      f", counted {row['measured_gflops']:.2f} GFLOPs", file=sys.stderr, flush=True)
            rows.append(row)

    def rel(a, b):
        return f"{100 * (a / b - 1):+.2f}%" if isinstance(a, int | float) and isinstance(b, int | float) else "-"

    lines = [[r["model"], r["res"], r["tokens"], cell(r["gflops"]), cell(r["attention_gflops"]),
              cell(r["attention_read_gflops"]), cell(r.get("measured_gflops")), rel(r.get("measured_gflops"), r["gflops"]),
              cell(r.get("paper_gflops"), ".1f"), rel(r["gflops"], r.get("paper_gflops")),
              cell(r.get("paper_attention_gflops"), ".1f"), rel(r["attention_gflops"], r.get("paper_attention_gflops"))]
             for r in rows]
    print(text := markdown_table(["model", "res", "tokens", "GFLOPs", "attention GFLOPs", "read", "FlopCounterMode", "diff",
                                  "paper", "diff", "paper attention", "diff"], lines).rstrip("\n"))
    if out is not None:
        contents = {"json": json.dumps(rows, indent=1) + "\n", "md": text + "\n", "csv": csv_text(rows)}
        for file, content in contents.items():
            write_text(out / f"flops.{file}", content, overwrite=True)
    return 0


def _check(args: argparse.Namespace, common: dict[str, Any], name: str, command_line: str) -> int:
    files = [f"{name}_checks.json", f"{name}_table.md"]
    if args.from_json:
        try:
            meta, rows = read_results(args.from_json)
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"{args.from_json} is not a results file of `ssogvit bench check`") from None
        meta = {"loadavg_end": meta.get("loadavg")} | meta | {"command": command_line}
        out = _claim(args.out, files, args.overwrite)
    else:
        points = check_points(resolutions=args.res, batches=args.batch or [1, 8], models=args.models,
                              model_batch=args.model_batch, train_resolutions=args.train_res,
                              train_batches=args.train_batch, **common)
        out = _claim(args.out, files + [f"{name}.json", f"{name}.csv"], args.overwrite)
        rows, meta = _sweep(points, args, common, out, name, command_line, repeats=args.repeats,
                            repeat_below_ms=args.repeat_below_ms)
    checks = evaluate(rows, Thresholds(**{f.name: getattr(args, f.name) for f in fields(Thresholds)}))
    write_text(out / f"{name}_checks.json", json.dumps(checks, indent=1) + "\n", overwrite=True)
    _write_table(_header(meta, common["device"]) + "\n" + format_check(checks), out, f"{name}_table")
    met, missed = sum(r["met"] is True for r in checks), sum(r["met"] is False for r in checks)
    print(f"\n{met} checks passed, {missed} failed; wrote {out / (name + '_table.md')}")
    return 1 if missed else 0
