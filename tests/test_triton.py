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

def problem(grid, prefix, seed, b=2, h=2, r=3, dh=8, sparse=False):
    g = torch.Generator().manual_seed(seed)
    gh, gw = grid
    f64 = dict(dtype=torch.float64)
    mu = torch.randn(h, r, 2, generator=g, **f64) * 1.5
    sig = 0.4 + torch.rand(h, r, 2, generator=g, **f64)
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
orig = triton_backend._TritonMix.apply
triton_backend._TritonMix.apply = lambda *a: calls.append(1) or orig(*a)
v, ky, kx, lam, w = problem((3, 4), 1, seed=5)
ops.ssog_mix(v, (3, 4), ky, kx, lam, impl="auto")
auto_calls = len(calls)
ops.ssog_mix(v, (3, 4), ky, kx, lam, impl="triton")
out["dispatch"] = {"auto_cpu_calls": auto_calls, "triton_calls": len(calls) - auto_calls}
triton_backend._TritonMix.apply = orig

# double backward through the kernel raises (its values' gradient is written by the kernel, outside autograd)
# (a gradient penalty: d/dw of |dL/dvalues|^2 with L = sum(w * mix(values)); only the prefix term of dL/dvalues
# would be on autograd's tape, so without the guard the result is silently wrong)
v, ky, kx, lam, w = problem((3, 4), 1, seed=6)
v, w = v.requires_grad_(), w.requires_grad_()
try:
    g = torch.autograd.grad((ops.ssog_mix(v, (3, 4), ky, kx, lam, impl="triton") * w).sum(), v, create_graph=True)[0]
    torch.autograd.grad(g.square().sum(), w)
    out["double_backward"] = "no error"
except RuntimeError as e:
    out["double_backward"] = str(e)

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


def test_double_backward_through_the_kernel_raises_instead_of_being_wrong(interp_results):
    assert "is once differentiable" in interp_results["double_backward"], interp_results["double_backward"]


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

    class FakeCuda:  # auto_picks_triton's dtype rule, on a stand-in for a CUDA tensor
        is_cuda = True

        def __init__(self, dtype):
            self.dtype = dtype

    monkeypatch.setattr(triton_backend, "triton_usable", lambda t, grid, atoms: True)
    monkeypatch.setattr(triton_backend, "tf32_enabled", lambda: False)
    picks = {dt: triton_backend.auto_picks_triton(FakeCuda(dt), (14, 14), 4)
             for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
    assert picks == {torch.float64: False, torch.float32: False, torch.float16: True, torch.bfloat16: True}
    monkeypatch.setattr(triton_backend, "tf32_enabled", lambda: True)
    assert triton_backend.auto_picks_triton(FakeCuda(torch.float32), (14, 14), 4)
    assert not triton_backend.auto_picks_triton(torch.zeros(1), (14, 14), 4)


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
    consts = ("GH_P", "GW_P", "R_P", "BD", "PRECISION", "ACC")
    cases = [(torch.float16, "fp16", "tf32", 14, 4, 64), (torch.float32, "fp32", "ieee", 7, 3, 16)]
    for dtype, tdt, prec, gw, r, dh in cases:
        gw_p, r_p, bd, warps = tk._config(gw, r, dh, dtype)
        sig = {n: ("constexpr" if n in consts else "*" + tdt if n.endswith("_ptr") else "i32") for n in names}
        values = dict(GH_P=16, GW_P=gw_p, R_P=r_p, BD=bd, PRECISION=prec, ACC=tl.float32)
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
