#!/usr/bin/env python
"""GPU check of the fused Triton fixed-SSoG kernel: exactness, then timing against SDPA (FlashAttention).

Run on a CUDA machine from the repository root (``PYTHONPATH=src python scripts/gpu_check.py --out DIR``; a few
minutes, most of it Triton compilation; keep the whole run under 8 minutes). It does not run anywhere else: without
CUDA it exits with status 2. Each case is guarded, so one failure does not lose the rest, and every result is
appended to ``DIR/gpu_check.jsonl`` as soon as it is measured (a run cut short keeps what it measured).

1. Exactness on CUDA: impl="triton" against impl="stacked" (the torch path, same dtype) and against a float64
   reference, forward and gradients (values, ky, kx, lam), fp64, fp32 (TF32 off), fp16 and bf16, several grids and
   prefix counts, the 64x64 grid of 1024 px included (8 warps, 64-wide channel tiles); double backward equal to
   the einsum path's; what impl="auto" picks on CUDA (Triton for fp16/bf16 and TF32 fp32; the torch path for fp32
   without TF32 and fp64); the registered ops (``torch.ops.ssogvit.triton_fixed_mix`` and its backward,
   ``torch.library.triton_op``) through the whole ``torch.library.opcheck`` (fake tensors and AOT dispatch need a
   GPU); NaN and infinities in the values and the mixture weights where the torch path has them; one small case
   under ``compute-sanitizer --tool memcheck`` when the tool is installed.
2. Timing, fp16, ViT-B width (D=768, H=12, R=4, patch 16, one class token), batch 8, at 224, 512 and 1024 px:
   the token-mixing core alone (fixed SSoG: Triton and stacked; attention: SDPA restricted to FlashAttention), and
   the whole mixer (projections included: SSoGAttention against the fused MHA ``Attention``), forward and
   forward+backward, eager and under ``torch.compile(fullgraph=True)`` (compile time and graph count recorded);
   the core's backward with the kernel gradients (ky, kx, lam) as training needs them. Median of ``--iters`` timed
   iterations after ``--warmup`` (CUDA events, synchronised), and the peak memory above the inputs. Prints one
   table; ``--json PATH`` also writes the rows.
3. A sweep of the kernel's launch configuration (channels per program, warps) at the smallest and largest
   resolution (``--no-sweep`` skips it): the defaults were chosen without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


class Recorder:
    """Appends each result as one JSON line to ``path`` at once (flushed), so a run cut short keeps what it did."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.failures = 0

    def __call__(self, **row) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def guarded(self, section: str, name: str, fn):
        """``fn()``, or ``None`` with the error recorded (and counted) instead of ending the run."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one broken case must not lose the others
            self.failures += 1
            tb = traceback.format_exc().strip().splitlines()[-3:]
            print(f"   {section} {name}: ERROR {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
            self(section=section, name=name, error=f"{type(exc).__name__}: {exc}", traceback=tb)
            torch.cuda.empty_cache()
            return None


def set_tf32(on: bool) -> None:
    """Through the new setting where torch has it (reading the legacy flag raises once the new one is set)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = on


def problem(grid, prefix, *, b, h, r, dh, device, seed):
    from ssogvit import ops

    g = torch.Generator().manual_seed(seed)
    gh, gw = grid
    f64 = dict(dtype=torch.float64)
    mu = torch.randn(h, r, 2, generator=g, **f64) * 1.5
    sig = 0.4 + torch.rand(h, r, 2, generator=g, **f64) * 1.5
    tau = torch.tensor(0.8, **f64)
    ky = ops.axis_kernels(gh, mu[..., 0], sig[..., 0], tau)
    kx = ops.axis_kernels(gw, mu[..., 1], sig[..., 1], tau)
    lam = torch.softmax(torch.randn(h, r, generator=g, **f64), -1)
    v = torch.randn(b, prefix + gh * gw, h * dh, generator=g, **f64)
    w = torch.randn(b, prefix + gh * gw, h * dh, generator=g, **f64)
    return [t.to(device) for t in (v, ky, kx, lam, w)]


def run(impl, dtype, v, ky, kx, lam, w, grid):
    from ssogvit import ops

    leaves = [t.detach().to(dtype).requires_grad_() for t in (v, ky, kx, lam)]
    y = ops.ssog_mix(leaves[0], grid, *leaves[1:], impl=impl)
    grads = torch.autograd.grad((y * w.to(dtype)).sum(), leaves)
    return [y.detach()] + list(grads)


EXACT_CASES = [((1, 7), 0, 12, 3, 8), ((5, 7), 2, 12, 3, 8), ((6, 6), 1, 12, 3, 8), ((14, 14), 1, 64, 12, 4),
               ((9, 20), 0, 32, 4, 4), ((32, 32), 1, 64, 12, 4), ((70, 33), 1, 16, 2, 4),
               ((64, 64), 1, 64, 12, 4)]  # (grid, P, dh, H, R); 64x64 is 1024 px: 8 warps, 64-wide tiles
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
NAMES = ["out", "d_values", "d_ky", "d_kx", "d_lam"]


def exact_case(rec: Recorder, device, i, case, dtypes) -> bool:
    from ssogvit.backends import _triton_kernels as tk

    grid, p, dh, h, r = case
    prob = problem(grid, p, b=2, h=h, r=r, dh=dh, device=device, seed=i)
    ref = run("einsum", torch.float64, *prob, grid)
    ok = True
    for dt in dtypes:
        def one(dt=dt):
            tri = run("triton", dt, *prob, grid)
            st = run("stacked", dt, *prob, grid)
            e_ref = [rel(a, b) for a, b in zip(tri, ref)]
            e_st = [rel(a, b) for a, b in zip(tri, st)]
            st_ref = [rel(a, b) for a, b in zip(st, ref)]
            # fp64/fp32: absolute tolerance; half types: no worse than the torch path's own error (x4) or the tolerance
            bound = [TOL[dt] if dt in (torch.float64, torch.float32) else max(TOL[dt], 4 * s) for s in st_ref]
            bad = [n for n, e, lim in zip(NAMES, e_ref, bound) if not e < lim]
            bad += [n for n, t in zip(NAMES, tri) if t.dtype != dt]
            cells = "  ".join(f"{a:9.1e}/{b:7.1e}" for a, b in zip(e_ref, e_st))
            config = tk._config(grid[1], r, dh, dt)
            print(f"{grid[0]:>3}x{grid[1]:<3} {p:>2} {dh:>3} {h:>3} {r:>2} {str(dt)[6:]:>9}  {cells}  "
                  + ("ok" if not bad else f"FAIL {bad}") + f"  (bd {config[2]}, warps {config[3]})", flush=True)
            rec(section="exact", grid=grid, prefix=p, dh=dh, heads=h, atoms=r, dtype=str(dt), vs_f64=e_ref,
                vs_stacked=e_st, stacked_vs_f64=st_ref, bd=config[2], warps=config[3], ok=not bad, bad=bad)
            return not bad

        ok &= bool(rec.guarded("exact", f"{grid} {dt}", one))
    return ok


def check_exactness(rec: Recorder, device, cases=EXACT_CASES,
                    dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16)) -> bool:
    from ssogvit import ops
    from ssogvit.backends import triton as triton_backend

    set_tf32(False)
    torch.backends.cudnn.allow_tf32 = False
    ok = True
    print("== exactness: impl='triton' against float64 einsum and against impl='stacked' (same dtype) ==")
    print(f"{'grid':>7} {'P':>2} {'dh':>3} {'H':>3} {'R':>2} {'dtype':>9}  " + "  ".join(f"{n:>9}" for n in NAMES)
          + "   (max |err| / max |ref|; vs f64 / vs stacked)", flush=True)
    for i, case in enumerate(cases):
        ok &= exact_case(rec, device, i, case, dtypes)

    def dispatch():  # what "auto" picks on CUDA, per dtype and TF32 setting
        v, ky, kx, lam, _ = problem((4, 5), 1, b=1, h=2, r=2, dh=16, device=device, seed=0)
        picks = {}
        try:
            for dt, tf32 in ((torch.float16, False), (torch.bfloat16, False), (torch.float32, False),
                             (torch.float32, True), (torch.float64, False)):
                set_tf32(tf32)
                name = ops.backend_for("fixed", "auto", v.to(dt), ky.to(dt), kx.to(dt), lam.to(dt))
                picks[f"{str(dt)[6:]}{'+tf32' if tf32 else ''}"] = name == "triton"
        finally:
            set_tf32(False)
        expected = {"float16": True, "bfloat16": True, "float32": False, "float32+tf32": True, "float64": False}
        print(f"impl='auto' on CUDA takes the Triton path: {picks} (expected {expected})", flush=True)
        rec(section="dispatch", picks=picks, ok=picks == expected)
        return picks == expected

    def wide():  # a grid too wide for the kernel's shared memory (4096 px at patch 16): "auto" falls back
        v = torch.zeros(1, 4 * 256, 64, device=device, dtype=torch.float16)
        tables = (torch.zeros(1, 4, 4, 4, device=device, dtype=torch.float16),
                  torch.zeros(1, 4, 256, 256, device=device, dtype=torch.float16),
                  torch.zeros(1, 4, device=device, dtype=torch.float16))
        reason = triton_backend.unsupported("fixed", v, *tables, auto=True)
        kib = triton_backend._kernels().shared_bytes(256, 4, 64, torch.float16) // 1024
        print(f"grid width 256, 4 atoms, fp16: refused = {reason!r} (expected a refusal: {kib} KiB of shared memory)")
        rec(section="shared-memory", reason=reason, kib=kib, ok=reason is not None)
        return reason is not None

    def double_backward():  # a gradient penalty through the kernel: the einsum path's second derivative
        def penalty(impl):
            v, ky, kx, lam, w = problem((3, 4), 1, b=1, h=2, r=2, dh=16, device=device, seed=1)
            v, ky = v.float().requires_grad_(), ky.float().requires_grad_()
            y = ops.ssog_mix(v, (3, 4), ky, kx.float(), lam.float(), impl=impl)
            (g,) = torch.autograd.grad((y * w.float()).sum(), v, create_graph=True)
            return torch.autograd.grad(g.square().sum(), ky)[0]

        err = rel(penalty("triton"), penalty("einsum"))
        print(f"double backward through the kernel against the einsum path: {err:.2e}", flush=True)
        rec(section="double-backward", err=err, ok=err < 1e-5)
        return err < 1e-5

    def opcheck():  # the registered ops, every check torch.library.opcheck has
        mod = triton_backend._kernels()
        v, ky, kx, lam, w = problem((5, 7), 1, b=2, h=2, r=3, dh=16, device=device, seed=2)
        for dt in (torch.float32, torch.float16):
            args = [t.to(dt) for t in (v, ky, kx, lam)]
            # without gradients: the forward op has no autograd of its own, ops._FixedMix wires it (docs/operator.md)
            torch.library.opcheck(mod.fixed_mix, tuple(args))
            torch.library.opcheck(mod.fixed_mix_backward, (w.to(dt), *args))
        print("torch.library.opcheck of triton_fixed_mix and triton_fixed_mix_backward (fp32, fp16): ok", flush=True)
        rec(section="opcheck", ok=True)
        return True

    def nonfinite():  # NaN and infinities in the values and the mixture weights, against the torch path
        bad = []
        for which, index in ((0, 40), (3, 1)):
            for poison in (float("nan"), float("inf"), -float("inf")):
                outs = {}
                for impl in ("triton", "stacked"):
                    v, ky, kx, lam, w = problem((6, 9), 1, b=2, h=2, r=3, dh=16, device=device, seed=3)
                    args = [v, ky, kx, lam]
                    args[which].view(-1)[index] = poison
                    outs[impl] = run(impl, torch.float32, *args, w, (6, 9))
                for a, b in zip(outs["triton"], outs["stacked"]):
                    same = (torch.equal(a.isnan(), b.isnan()) and torch.equal(a == float("inf"), b == float("inf"))
                            and torch.equal(a == -float("inf"), b == -float("inf")))
                    if not same:
                        bad.append((which, index, poison))
        print(f"NaN/inf in values and mixture weights where the torch path has them: {'ok' if not bad else bad}")
        rec(section="nonfinite", bad=[str(b) for b in bad], ok=not bad)
        return not bad

    for name, fn in (("dispatch", dispatch), ("shared-memory", wide), ("double-backward", double_backward),
                     ("opcheck", opcheck), ("nonfinite", nonfinite)):
        ok &= bool(rec.guarded(name, name, fn))
    set_tf32(True)
    return ok


def memcheck_case(device) -> None:
    """One small fp32 and fp16 case, forward and backward, for ``compute-sanitizer --tool memcheck``."""
    for dt in (torch.float32, torch.float16):
        prob = problem((5, 7), 1, b=2, h=2, r=3, dh=16, device=device, seed=3)
        run("triton", dt, *prob, (5, 7))
    torch.cuda.synchronize()
    print("memcheck case done")


def run_memcheck(rec: Recorder) -> bool:
    tool = shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path("/usr/local").glob("cuda*/bin/compute-sanitizer") if p.is_file()), None)
    if tool is None:
        print("compute-sanitizer: not installed, memcheck skipped", flush=True)
        rec(section="memcheck", skipped="compute-sanitizer not found")
        return True
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, __file__, "--memcheck-case"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    summary = [ln for ln in proc.stdout.splitlines() if "ERROR SUMMARY" in ln]
    ok = proc.returncode == 0
    print(f"compute-sanitizer memcheck: exit {proc.returncode}, {summary[-1] if summary else 'no summary'} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    rec(section="memcheck", returncode=proc.returncode, summary=summary, tail=proc.stdout[-2000:] + proc.stderr[-2000:],
        ok=ok)
    return ok


def cuda_time(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs (CUDA events), after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(rec: Recorder, device, resolutions, batch, warmup, iters):
    rows = []

    def add(**row):
        rows.append(row)
        rec(section="timing", batch=batch, **row)
        print(f"   {row['res']:>5} {row['what']:>5} {row['pass_']:>11} {row['name']:>13} {row['ms']:9.3f} ms "
              f"{row['mib']:9.1f} MiB", flush=True)

    for res in resolutions:
        rec.guarded("timing", f"{res} px", lambda res=res: bench_resolution(add, device, res, batch, warmup, iters))
        from torch._dynamo.utils import counters  # the compiled mixers so far: graphs (one per shape and mode), breaks

        rec(section="compile", res=res, unique_graphs=counters["stats"]["unique_graphs"],
            graph_breaks=dict(counters["graph_break"]))
        print(f"   compiled so far: {counters['stats']['unique_graphs']} graphs, graph breaks "
              f"{dict(counters['graph_break']) or 'none'}", flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_resolution(add, device, res, batch, warmup, iters):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ssogvit import ops
    from ssogvit.layers import Attention, SSoGAttention

    d, h, r, patch = 768, 12, 4, 16
    dh = d // h
    dt = torch.float16
    g = res // patch
    t = 1 + g * g
    grid = (g, g)
    ssog = SSoGAttention(d, h, num_atoms=r, impl="triton").to(device)
    ssog_st = SSoGAttention(d, h, num_atoms=r, impl="stacked").to(device)
    ssog_st.load_state_dict(ssog.state_dict())
    mha = Attention(d, h).to(device)
    with torch.no_grad():
        ky, kx, lam = (k.to(dt) for k in ssog._fixed_kernels(grid, dt))
    x = torch.randn(batch, t, d, device=device, dtype=dt)
    vals = torch.randn(batch, t, d, device=device, dtype=dt)
    q, k, v = (torch.randn(batch, h, t, dh, device=device, dtype=dt) for _ in range(3))

    def flash(q=q, k=k, v=v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    core = {
        "ssog-triton": lambda: ops.ssog_mix(vals, grid, ky, kx, lam, impl="triton"),
        "ssog-stacked": lambda: ops.ssog_mix(vals, grid, ky, kx, lam, impl="stacked"),
        "sdpa-flash": flash,
    }
    mixers = {"ssog-triton": ssog, "ssog-stacked": ssog_st, "mha-sdpa": mha}
    for name in ("ssog-triton", "mha-sdpa"):  # compiled: one graph (fullgraph), the kernel a node of it
        mixers[f"{name}-c"] = torch.compile(mixers[name], fullgraph=True)
    for name, fn in core.items():
        with torch.inference_mode():
            ms = cuda_time(fn, warmup, iters)
            mem = peak_mib(fn)
        add(res=res, tokens=t, what="core", name=name, pass_="fwd", ms=ms, mib=mem)
    for name, fn in core.items():  # forward + backward of the core
        leaves = ([vals.detach().requires_grad_()] if name != "sdpa-flash"
                  else [q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()])

        def step(name=name, leaves=leaves):
            if name == "sdpa-flash":
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    y = F.scaled_dot_product_attention(*leaves)
            else:
                y = ops.ssog_mix(leaves[0], grid, ky, kx, lam, impl=name.split("-")[1])
            y.backward(torch.ones_like(y))

        ms = cuda_time(step, warmup, iters)
        add(res=res, tokens=t, what="core", name=name, pass_="fwd+bwd", ms=ms, mib=peak_mib(step))
    for impl in ("triton", "stacked"):  # the core's backward with the kernel gradients, as in training
        leaves = [z.detach().requires_grad_() for z in (vals, ky, kx, lam)]  # fp16, as the module passes them

        def train_step(impl=impl, leaves=leaves):
            y = ops.ssog_mix(leaves[0], grid, *leaves[1:], impl=impl)
            y.backward(torch.ones_like(y))

        ms = cuda_time(train_step, warmup, iters)
        add(res=res, tokens=t, what="core", name=f"ssog-{impl}", pass_="fwd+bwd+dK", ms=ms, mib=peak_mib(train_step))
    for name, m in mixers.items():  # whole mixer, projections included, fp16 autocast
        def fwd(m=m):
            with torch.autocast("cuda", dtype=dt):
                return m(x, grid=grid, num_prefix_tokens=1)

        with torch.inference_mode():
            compile_s = first_call_s(fwd)
            ms = cuda_time(fwd, warmup, iters)
            mem = peak_mib(fwd)
        add(res=res, tokens=t, what="mixer", name=name, pass_="fwd", ms=ms, mib=mem, first_call_s=compile_s)
    for name, m in mixers.items():  # whole mixer, forward + backward (parameters' gradients included)
        xg = x.detach().requires_grad_()

        def fwd_bwd(m=m, xg=xg):
            with torch.autocast("cuda", dtype=dt):
                y = m(xg, grid=grid, num_prefix_tokens=1)
            y.float().sum().backward()

        compile_s = first_call_s(fwd_bwd)
        ms = cuda_time(fwd_bwd, warmup, iters)
        add(res=res, tokens=t, what="mixer", name=name, pass_="fwd+bwd", ms=ms, mib=peak_mib(fwd_bwd),
            first_call_s=compile_s)


def first_call_s(fn) -> float:
    """Seconds of one synchronised call (for a compiled function's first call: its compile time)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def sweep(rec: Recorder, device, resolutions, batch, warmup, iters):
    """Forward time of the Triton core in fp16 for each launch configuration (channels per program, warps)."""
    from ssogvit import ops
    from ssogvit.backends import _triton_kernels as tk
    from ssogvit.layers import SSoGAttention

    d, h, r, patch = 768, 12, 4, 16
    dt = torch.float16
    print(f"\n== launch-configuration sweep, fp16 core forward, batch {batch} (ms) ==")
    for res in resolutions:
        g = res // patch
        grid = (g, g)
        m = SSoGAttention(d, h, num_atoms=r).to(device)
        with torch.no_grad():
            ky, kx, lam = m._fixed_kernels(grid, dt)
        vals = torch.randn(batch, 1 + g * g, d, device=device, dtype=dt)
        fn = lambda: ops.ssog_mix(vals, grid, ky, kx, lam, impl="triton")  # noqa: E731
        with torch.inference_mode():
            tk.OVERRIDE.clear()
            default = cuda_time(fn, warmup, iters)
            cells = [f"default {default:.3f}"]
            for bd in (16, 32, 64):
                for warps in (4, 8):
                    tk.OVERRIDE.update(bd=bd, warps=warps)
                    try:
                        cells.append(f"bd{bd}/w{warps} {cuda_time(fn, warmup, iters):.3f}")
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for one configuration
                        cells.append(f"bd{bd}/w{warps} failed ({type(exc).__name__})")
            tk.OVERRIDE.clear()
        print(f"{res:>5}: " + "  ".join(cells), flush=True)
        rec(section="sweep", res=res, cells=cells)


def print_table(rows, batch, warmup, iters):
    print(f"\n== timing, fp16, D=768 H=12 R=4 patch 16, batch {batch}: median of {iters} after "
          f"{warmup} warm-up (ms), peak MiB above inputs ==")
    print(f"{'res':>5} {'tokens':>6} {'what':>5} {'pass':>10} {'name':>13} {'ms':>9} {'MiB':>9} {'vs flash/mha':>12}")
    for row in rows:
        base_name = "sdpa-flash" if row["what"] == "core" else "mha-sdpa"
        base = next((b for b in rows if b["res"] == row["res"] and b["what"] == row["what"]
                     and b["pass_"] == row["pass_"] and b["name"] == base_name), None)
        speed = f"{base['ms'] / row['ms']:11.2f}x" if base else "          -"
        print(f"{row['res']:>5} {row['tokens']:>6} {row['what']:>5} {row['pass_']:>10} {row['name']:>13} "
              f"{row['ms']:9.3f} {row['mib']:9.1f} {speed}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resolutions", type=int, nargs="+", default=[224, 512, 1024])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    ap.add_argument("--no-memcheck", action="store_true", help="skip the compute-sanitizer run")
    ap.add_argument("--memcheck-case", action="store_true", help=argparse.SUPPRESS)  # run under compute-sanitizer
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.jsonl (default $OUT or .)")
    ap.add_argument("--json", default=None, help="also write the timing rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA device; none is available", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.set_grad_enabled(True)
    if args.memcheck_case:
        memcheck_case(device)
        return 0
    rec = Recorder(Path(args.out) / "gpu_check.jsonl")
    import triton

    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"results appended to {rec.path}", flush=True)
    rec(section="device", name=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__)
    ok = True if args.skip_exactness else check_exactness(rec, device)
    if not args.no_memcheck:
        ok &= bool(rec.guarded("memcheck", "memcheck", lambda: run_memcheck(rec)))
    rows = bench(rec, device, args.resolutions, args.batch, args.warmup, args.iters)
    print_table(rows, args.batch, args.warmup, args.iters)
    if not args.no_sweep:
        rec.guarded("sweep", "sweep", lambda: sweep(
            rec, device, sorted({min(args.resolutions), max(args.resolutions)}), args.batch, args.warmup, args.iters))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok &= rec.failures == 0
    print(f"\nexactness and checks: {'PASS' if ok else 'FAIL'} ({rec.failures} case(s) raised); results in {rec.path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
