"""The fused Triton kernel of fixed SSoG, checked for exactness on CPU under the Triton interpreter.

There is no GPU in CI: ``TRITON_INTERPRET=1`` runs the same kernel source on CPU tensors with numpy. The variable must
be set before the kernel is defined, so the checks run in one subprocess (``_CHECKS`` below) that prints its
measurements as JSON; each test here asserts on one of them. The rest of the suite never sees the variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Cases: (name, dtype, grid, prefix tokens). float64 covers every grid and prefix count; the others fewer (the
# interpreter takes about a second per kernel launch on these shapes).
CASES = [
    ("f64-1x7-p0", "float64", (1, 7), 0),
    ("f64-1x7-p2", "float64", (1, 7), 2),
    ("f64-5x7-p0", "float64", (5, 7), 0),
    ("f64-5x7-p2", "float64", (5, 7), 2),
    ("f64-6x6-p0", "float64", (6, 6), 0),
    ("f64-6x6-p2", "float64", (6, 6), 2),
    ("f32-1x7-p2", "float32", (1, 7), 2),
    ("f32-5x7-p0", "float32", (5, 7), 0),
    ("f32-6x6-p2", "float32", (6, 6), 2),
    ("f16-5x7-p2", "float16", (5, 7), 2),
]
# max |error| / max |reference| allowed, per dtype, for the output and for each gradient
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}

_CHECKS = r"""
import json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
out = {}

# -- without Triton first (one process for everything: importing ssogvit costs seconds) ---------------------------
# "missing": import triton raises ImportError; "broken": Triton imports but defining the kernel raises something
# else. (A Triton whose own import raises breaks torch's import chain (torch._dynamo, via timm/torchvision) before
# ssogvit runs, so that case is not ssogvit's to guard.)
sys.modules["triton"] = None
import torch
torch.set_num_threads(1)
import ssogvit
from ssogvit import ops
from ssogvit.backends import triton as triton_backend
from ssogvit.layers import SSoGAttention

def without_triton():
    triton_backend._STATE.clear()
    m = SSoGAttention(8, 2, num_atoms=2)  # impl="auto"
    y = m(torch.randn(1, 1 + 6, 8), grid=(2, 3))
    res = {"auto_ok": tuple(y.shape) == (1, 7, 8), "available": triton_backend.triton_available(),
           "reason": triton_backend.triton_import_error(), "error": None}
    try:
        ops.ssog_mix(torch.randn(1, 6, 8), (2, 3), torch.rand(2, 2, 2, 2), torch.rand(2, 2, 3, 3),
                     torch.rand(2, 2), impl="triton")
    except RuntimeError as e:
        res["error"] = str(e)
    return res

out["missing"] = without_triton()
del sys.modules["triton"]
try:
    import triton
    import triton.language
except Exception as exc:  # no (working) Triton here: only the checks above apply
    out["triton_error"] = f"{type(exc).__name__}: {exc}"
    print("RESULTS " + json.dumps(out))
    sys.exit(0)
real_jit = triton.jit
def jit(*args, **kwargs):
    raise RuntimeError("broken triton (planted by the test)")
triton.jit = jit
out["broken"] = without_triton()
triton.jit = real_jit
triton_backend._STATE.clear()

# -- under the interpreter -----------------------------------------------------------------------------------------
CASES, = json.loads(sys.argv[1]),

def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))

def problem(grid, prefix, seed, b=2, h=2, r=3, dh=8, sparse=False, narrow=False):
    g = torch.Generator().manual_seed(seed)
    gh, gw = grid
    f64 = dict(dtype=torch.float64)
    mu = torch.randn(h, r, 2, generator=g, **f64) * 1.5
    sig = 0.4 + torch.rand(h, r, 2, generator=g, **f64) if not narrow else torch.full((h, r, 2), 0.05, **f64)
    tau = torch.tensor(0.8, **f64)
    ky = ops.axis_kernels(gh, mu[..., 0], sig[..., 0], tau)
    kx = ops.axis_kernels(gw, mu[..., 1], sig[..., 1], tau)
    if sparse:  # exact zeros, whole zero rows included: exercises the kernel's row ranges [lo, hi)
        ky = ky * (torch.rand(ky.shape, generator=g, **f64) < 0.4)
        ky[:, :, 1] = 0.0
        ky[0, :, 2, : gh // 2] = 0.0
    lam = torch.softmax(torch.randn(h, r, generator=g, **f64), -1)
    v = torch.randn(b, prefix + gh * gw, h * dh, generator=g, **f64)
    w = torch.randn(b, prefix + gh * gw, h * dh, generator=g, **f64)
    return v, ky, kx, lam, w

def run(impl, dtype, v, ky, kx, lam, w, grid):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (v, ky, kx, lam)]
    y = ops.ssog_mix(*leaves[:1], grid, *leaves[1:], impl=impl)
    grads = torch.autograd.grad((y * w.to(dtype)).sum(), leaves)
    return [y.detach()] + list(grads)

NAMES = ["out", "d_values", "d_ky", "d_kx", "d_lam"]
for i, (name, dtype, grid, prefix) in enumerate(CASES):
    dt = getattr(torch, dtype)
    prob = problem(tuple(grid), prefix, seed=i)
    ref = run("einsum", torch.float64, *prob, tuple(grid))  # plain einsum + autograd, float64
    tri = run("triton", dt, *prob, tuple(grid))
    res = {f"{k}_vs_f64": rel(a, b) for k, a, b in zip(NAMES, tri, ref)}
    if dtype != "float64":
        st = run("stacked", dt, *prob, tuple(grid))  # the CPU path (_StackedMix) in the same dtype
        res.update({f"{k}_vs_stacked": rel(a, b) for k, a, b in zip(NAMES, tri, st)})
        res.update({f"stacked_{k}_vs_f64": rel(a, b) for k, a, b in zip(NAMES, st, ref)})
    res["dtypes_ok"] = all(t.dtype == dt for t in tri)
    out[name] = res

# exact zeros in the y-kernels (row ranges), float64
prob = problem((6, 6), 1, seed=99, sparse=True)
ref, tri = run("einsum", torch.float64, *prob, (6, 6)), run("triton", torch.float64, *prob, (6, 6))
kyl = prob[1] * prob[3][:, :, None, None]
nz = (kyl != 0).any(dim=1)  # (H, Gh, Gh): the source rows each query row needs
span = nz.shape[-1] - nz.int().argmax(-1) - nz.flip(-1).int().argmax(-1)  # width of the span of needed rows
out["sparse"] = {f"{k}_vs_f64": rel(a, b) for k, a, b in zip(NAMES, tri, ref)}
out["sparse"]["narrowed_rows"] = int(((span < nz.shape[-1]) & nz.any(-1)).sum())
out["sparse"]["empty_rows"] = int((~nz.any(-1)).sum())

# the module with impl="triton" against impl="stacked", float64, parameters' gradients included
torch.manual_seed(0)
m = SSoGAttention(16, 2, num_atoms=3, impl="stacked").double()
with torch.no_grad():
    m.rho.normal_(0.0, 0.7); m.ell.normal_(0.0, 1.0); m.theta.fill_(0.3)
x = torch.randn(2, 1 + 3 * 4, 16, dtype=torch.float64, requires_grad=True)
params = [x] + list(m.parameters())
res = {}
for impl in ("stacked", "triton"):
    m.impl = impl
    y = m(x, grid=(3, 4))
    res[impl] = [y.detach()] + list(torch.autograd.grad(y.square().sum(), params))
out["module"] = {"max_rel": max(rel(a, b) for a, b in zip(res["triton"], res["stacked"]))}

# "auto" on a CPU tensor never takes the Triton path, even under the interpreter
calls = []
orig = triton_backend.fixed_forward
triton_backend.fixed_forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
v, ky, kx, lam, w = problem((3, 4), 1, seed=5)
ops.ssog_mix(v, (3, 4), ky, kx, lam, impl="auto")
auto_calls = len(calls)
ops.ssog_mix(v, (3, 4), ky, kx, lam, impl="triton")
out["dispatch"] = {"auto_cpu_calls": auto_calls, "triton_calls": len(calls) - auto_calls}
triton_backend.fixed_forward = orig

# double backward through the kernel (a gradient penalty: d/d(w, ky) of |dL/dvalues|^2 with L = sum(w * mix)): the
# backward that builds a graph is the einsum path's
def penalty(impl):
    v, ky, kx, lam, w = problem((3, 4), 1, seed=6)
    v, w, ky = v.requires_grad_(), w.requires_grad_(), ky.requires_grad_()
    g = torch.autograd.grad((ops.ssog_mix(v, (3, 4), ky, kx, lam, impl=impl) * w).sum(), v, create_graph=True)[0]
    return torch.autograd.grad(g.square().sum(), (w, ky))
out["double_backward"] = max(rel(a, b) for a, b in zip(penalty("triton"), penalty("einsum")))

# the ops pass torch.library.opcheck: schema and autograd registration (the fake implementation and AOT dispatch
# need a GPU: under the interpreter wrap_triton hands back the interpreted kernel itself, which then runs on fake
# tensors; scripts/gpu_check.py runs the whole opcheck)
mod = triton_backend._kernels()
v, ky, kx, lam, w = problem((3, 4), 1, seed=8)
opcheck = {}
for name, op, args in (("forward", mod.fixed_mix, [t.clone().requires_grad_() for t in (v, ky, kx, lam)]),
                       ("backward", mod.fixed_mix_backward, (w, v, ky, kx, lam))):
    try:
        torch.library.opcheck(op, tuple(args), test_utils=("test_schema", "test_autograd_registration"))
        opcheck[name] = "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        opcheck[name] = f"{type(e).__name__}: {str(e)[:2000]}"
out["opcheck"] = opcheck

# NaN and infinities in the values and in the mixture weights land where they land in the torch backend (kernels
# with exact zeros: narrow widths); also where every value is finite but one is NaN, the y-pass visits every row
def poisoned(impl, which, index, poison):
    v, ky, kx, lam, w = problem((6, 9), 1, seed=9, narrow=True)
    args = [v, ky, kx, lam]
    args[which].view(-1)[index] = poison
    leaves = [t.clone().requires_grad_() for t in args]
    y = ops.ssog_mix(leaves[0], (6, 9), *leaves[1:], impl=impl)
    return [y.detach(), *torch.autograd.grad((y * w).sum(), leaves)]

nonfinite = {}
for which, index in ((0, 40), (0, 301), (3, 1), (1, 17)):
    for poison in (float("nan"), float("inf"), float("-inf")):
        got, want = poisoned("triton", which, index, poison), poisoned("stacked", which, index, poison)
        same = all(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a == float("inf"), b == float("inf"))
                   and torch.equal(a == -float("inf"), b == -float("inf")) for a, b in zip(got, want))
        finite = all(torch.equal(torch.isfinite(a), torch.isfinite(b)) for a, b in zip(got, want))
        close = max(rel(a[torch.isfinite(b)], b[torch.isfinite(b)]) if torch.isfinite(b).any() else 0.0
                    for a, b in zip(got, want))
        nonfinite[f"{which}-{index}-{poison}"] = {"same": same, "finite_same": finite, "close": close,
                                                  "inf_and_nan": bool(torch.isinf(want[0]).any() and
                                                                      torch.isnan(want[0]).any())}
out["nonfinite"] = nonfinite

# the probe: passes on a working kernel, and a kernel that fails or computes a wrong result costs a warning and the
# torch path, once per device
import warnings
probe = {"ok": triton_backend._probe(torch.device("cpu"))}
mod = triton_backend._kernels()
real_launch = mod.launch_mix
for name, planted in (("raises", lambda *a: (_ for _ in ()).throw(RuntimeError("ptxas: unsupported"))),
                      ("wrong", lambda src, ky, kx, lam, dst, grid: dst.zero_())):
    triton_backend._STATE.pop(("probe", "cpu", None))
    mod.launch_mix = planted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe[name] = triton_backend._probe(torch.device("cpu"))
        probe[name + "_again"] = triton_backend._probe(torch.device("cpu"))  # cached: no second warning
    probe[name + "_warnings"] = [str(c.message) for c in caught]
mod.launch_mix = real_launch
out["probe"] = probe

# bfloat16: only if the interpreter's tl.dot handles it (triton 3.8's interpreter multiplies bf16 bit patterns as
# integers: create_dot stores bf16 as uint16 and calls np.matmul on them)
import triton, triton.language as tl

@triton.jit
def _probe(a, b, c, M: tl.constexpr):
    i = tl.arange(0, M)
    x = tl.load(a + i[:, None] * M + i[None, :])
    y = tl.load(b + i[:, None] * M + i[None, :])
    tl.store(c + i[:, None] * M + i[None, :], tl.dot(x, y))

A, B = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
C = torch.empty(16, 16)
_probe[(1,)](A, B, C, 16)
bf16_dot_ok = rel(C, A.float() @ B.float()) < 1e-2
out["bf16"] = {"interpreter_dot_ok": bf16_dot_ok}
if bf16_dot_ok:
    prob = problem((5, 7), 2, seed=7)
    ref, tri = run("einsum", torch.float64, *prob, (5, 7)), run("triton", torch.bfloat16, *prob, (5, 7))
    out["bf16"].update({f"{k}_vs_f64": rel(a, b) for k, a, b in zip(NAMES, tri, ref)})
print("RESULTS " + json.dumps(out))
"""


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def checks():
    """Everything ``_CHECKS`` measured (the checks without Triton run even where Triton is not installed)."""
    cases = [[n, dt, list(g), p] for n, dt, g, p in CASES]
    proc = subprocess.run(
        [sys.executable, "-c", _CHECKS, json.dumps(cases)],
        env=_env(TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def interp_results(checks):
    if "triton_error" in checks:
        pytest.skip(f"triton is not importable ({checks['triton_error']}); the interpreter checks need it")
    return checks


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_forward_and_gradients_match_references(interp_results, case):
    name, dtype, _, _ = case
    res = interp_results[name]
    tol = TOL[dtype]
    assert res["dtypes_ok"], f"{name}: outputs or gradients came back in another dtype"
    for key in ("out", "d_values", "d_ky", "d_kx", "d_lam"):
        if dtype == "float16":
            # half precision rounds the intermediate (as the stacked path does): hold the kernel to the stacked
            # path's own error against float64, with a margin, and to the absolute tolerance
            bound = max(tol, 4 * res[f"stacked_{key}_vs_f64"])
            assert res[f"{key}_vs_f64"] < bound, (name, key, res)
        else:
            assert res[f"{key}_vs_f64"] < tol, (name, key, res)
        if dtype != "float64":
            assert res[f"{key}_vs_stacked"] < 4 * tol, (name, key, res)


def test_triton_skips_exact_zero_rows_exactly(interp_results):
    res = interp_results["sparse"]
    assert res["narrowed_rows"] > 0 and res["empty_rows"] > 0, res  # the case really exercises the row ranges
    for key in ("out", "d_values", "d_ky", "d_kx", "d_lam"):
        assert res[f"{key}_vs_f64"] < TOL["float64"], (key, res)


def test_triton_module_matches_stacked(interp_results):
    assert interp_results["module"]["max_rel"] < 1e-12, interp_results["module"]


def test_auto_never_picks_triton_on_cpu(interp_results):
    assert interp_results["dispatch"] == {"auto_cpu_calls": 0, "triton_calls": 1}


def test_triton_bfloat16(interp_results):
    res = interp_results["bf16"]
    if not res["interpreter_dot_ok"]:
        pytest.skip("the Triton interpreter's tl.dot mishandles bfloat16 (bit patterns multiplied as integers); "
                    "bf16 is checked on a GPU by scripts/gpu_check.py")
    for key in ("out", "d_values", "d_ky", "d_kx", "d_lam"):
        assert res[f"{key}_vs_f64"] < TOL["bfloat16"], (key, res)


def test_double_backward_through_the_kernel_equals_the_einsum_path(interp_results):
    assert interp_results["double_backward"] < 1e-12, interp_results["double_backward"]


def test_the_triton_ops_pass_opcheck(interp_results):
    """``triton_fixed_mix`` and its backward, as registered ops (``torch.library.triton_op``), under the
    interpreter: schema and autograd registration (the fake implementation and AOT dispatch on a GPU only)."""
    assert interp_results["opcheck"] == {"forward": "ok", "backward": "ok"}, interp_results["opcheck"]


def test_nan_and_infinities_land_where_they_land_in_the_torch_backend(interp_results):
    """Values and mixture weights: NaN, +inf and -inf at the same places in the output and every gradient. An
    infinite kernel entry (arguments ``1-...``; the layer never makes one: its tables are softmax rows) is
    non-finite at the same places, but the kernel's y-pass-first order may make a NaN where the torch backend
    (x-pass first) makes an infinity (docs/operator.md, "Non-finite input")."""
    res = interp_results["nonfinite"]
    assert any(r["inf_and_nan"] for r in res.values())  # the cases see infinities and NaNs
    for case, r in res.items():
        assert r["finite_same"] and r["close"] < 1e-12, (case, r)
        if not case.startswith("1-"):
            assert r["same"], (case, r)


def test_a_kernel_that_fails_its_probe_falls_back_with_one_warning(interp_results):
    res = interp_results["probe"]
    assert res["ok"] is True
    for name, reason in (("raises", "RuntimeError: ptxas: unsupported"), ("wrong", "probe result differs")):
        assert res[name] is False and res[name + "_again"] is False, res
        assert len(res[name + "_warnings"]) == 1 and reason in res[name + "_warnings"][0], res
        assert "uses the torch path" in res[name + "_warnings"][0]


@pytest.mark.parametrize(
    "setting, expected",
    [({"matmul": "tf32"}, True), ({"matmul": "ieee"}, False), ({"global": "tf32"}, True),
     ({"legacy": True}, True), ({"legacy": False}, False)],
)
def test_tf32_is_read_from_the_new_setting_first(setting, expected):
    import torch

    from ssogvit.backends.triton import tf32_enabled

    matmul = torch.backends.cuda.matmul
    before = (matmul.fp32_precision, torch.backends.fp32_precision)
    try:
        if "legacy" in setting:
            matmul.allow_tf32 = setting["legacy"]
        matmul.fp32_precision = setting.get("matmul", "none")
        torch.backends.fp32_precision = setting.get("global", "none")
        if "legacy" in setting:
            matmul.allow_tf32 = setting["legacy"]
        assert tf32_enabled() is expected
    finally:
        matmul.fp32_precision, torch.backends.fp32_precision = "none", "none"
        matmul.allow_tf32 = False
        matmul.fp32_precision, torch.backends.fp32_precision = before


def test_auto_keeps_float64_and_float32_without_tf32_off_the_kernel(monkeypatch):
    import torch

    from ssogvit.backends import triton as triton_backend

    class FakeCuda:  # the probe's dtype rule for impl="auto", on a stand-in for a CUDA tensor
        is_cuda = True
        shape = (1, 197, 768)
        device = torch.device("cuda", 0)

        def __init__(self, dtype):
            self.dtype = dtype

    tables = (torch.zeros(12, 4, 14, 14), torch.zeros(12, 4, 14, 14), torch.zeros(12, 4))
    monkeypatch.setattr(triton_backend, "triton_usable", lambda t: True)
    monkeypatch.setattr(triton_backend, "_fits", lambda *a: True)
    monkeypatch.setattr(triton_backend, "_tf32", lambda: False)
    picks = {dt: triton_backend.unsupported("fixed", FakeCuda(dt), *tables, auto=True) is None
             for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
    assert picks == {torch.float64: False, torch.float32: False, torch.float16: True, torch.bfloat16: True}
    monkeypatch.setattr(triton_backend, "_tf32", lambda: True)
    assert triton_backend.unsupported("fixed", FakeCuda(torch.float32), *tables, auto=True) is None
    assert triton_backend.unsupported("fixed", torch.zeros(1, 197, 768), *tables, auto=True) is not None
    assert "no Triton kernel for the steered mixing" in triton_backend.unsupported("steered", FakeCuda(torch.float16),
                                                                                   auto=False)


@pytest.mark.parametrize("mode", ["missing", "broken"])
def test_ssogvit_works_without_triton(checks, mode):
    """``import ssogvit`` and the CPU paths never need Triton; impl="triton" then fails with the reason."""
    if mode not in checks:
        pytest.skip(f"triton is not importable ({checks['triton_error']}), so there is no installation to break")
    res = checks[mode]
    assert res["auto_ok"] and not res["available"], res
    expected = "ModuleNotFoundError" if mode == "missing" else "RuntimeError: broken triton"
    assert res["reason"].startswith(expected), res
    assert res["error"] is not None and res["error"].startswith("impl='triton' needs Triton"), res


def test_kernel_compiles_for_a_hopper_gpu():
    """The interpreter runs the kernel's Python semantics; this compiles it for sm_90 (H100/H200) down to a cubin,
    which needs no GPU, and checks the shared-memory estimate that ``impl="auto"`` relies on."""
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"triton (or its ahead-of-time compilation API) is not available: {type(exc).__name__}: {exc}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    import torch

    from ssogvit.backends import _triton_kernels as tk

    fn = tk._ssog_mix_kernel
    names = fn.arg_names
    consts = ("GH_P", "GW_P", "R_P", "BD", "PRECISION", "ACC", "TINY")
    cases = [(torch.float16, "fp16", "tf32", 14, 4, 64), (torch.float32, "fp32", "ieee", 7, 3, 16)]
    for dtype, tdt, prec, gw, r, dh in cases:
        gw_p, r_p, bd, warps = tk._config(gw, r, dh, dtype)
        sig = {n: ("constexpr" if n in consts else "*i1" if n == "finite_ptr" else "*" + tdt if n.endswith("_ptr")
                   else "i32") for n in names}
        values = dict(GH_P=16, GW_P=gw_p, R_P=r_p, BD=bd, PRECISION=prec, ACC=tl.float32,
                      TINY=torch.finfo(dtype).tiny)
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in values.items()})
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        except Exception as exc:  # noqa: BLE001
            if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
                pytest.skip(f"no ptxas for ahead-of-time compilation: {exc}")
            raise
        assert "cubin" in compiled.asm
        if dtype == torch.float16:
            assert "mma" in compiled.asm["ptx"], "the fp16 x-pass should run on tensor cores"
        assert compiled.metadata.shared <= tk.shared_bytes(gw, r, dh, dtype), (compiled.metadata.shared, dtype)
