"""One benchmark point, run in a fresh process: ``python -m ssogvit.bench._worker < spec.json``.

The spec (a JSON object on stdin) names what to build and how to run it; the result is printed as one JSON line
after ``RESULT_MARKER`` on stdout. The parent (``ssogvit.bench.runner``) never imports the model itself, so each
point's memory and failures are its own.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

RESULT_MARKER = "SSOGVIT_BENCH_RESULT "

_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory", "bad_alloc")


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def _build(spec: dict[str, Any], device, dtype_in) -> tuple[Any, Callable[[], Any], dict[str, Any]]:
    """Return ``(module, call, info)``: ``call()`` runs one forward on the point's input."""
    import torch

    from ssogvit.bench.flops import count_flops, grid_of, mixer_flops

    batch = int(spec["batch"])
    info: dict[str, Any] = {}
    if spec["kind"] == "model":
        from ssogvit.models import create_model

        res = int(spec["res"])
        kwargs = dict(spec.get("model_kwargs") or {})
        model = create_model(spec["model"], img_size=res, **kwargs)
        info["gflops_per_image"] = count_flops(model, res) / 1e9
        gh, gw = grid_of(model, res)
        info["grid"] = [gh, gw]
        info["tokens"] = int(getattr(model, "num_prefix_tokens", 1)) + gh * gw
        model = model.to(device)
        x = torch.randn(batch, getattr(model, "in_chans", 3), res, res, device=device, dtype=dtype_in)

        def call():
            return model(x)

    elif spec["kind"] == "operator":
        dim, heads, prefix = int(spec["dim"]), int(spec["heads"]), int(spec.get("prefix", 1))
        gh, gw = spec["grid"]
        options = dict(spec.get("mixer_options") or {})
        if spec["mixer"] == "torch-mha":
            model = torch.nn.MultiheadAttention(dim, heads, batch_first=True, **options)
        else:
            from ssogvit.layers import create_mixer

            model = create_mixer(spec["mixer"], dim, heads, **options)
        info["gflops_per_image"] = mixer_flops(model, (gh, gw), prefix)["total"] / 1e9
        model = model.to(device)
        x = torch.randn(batch, prefix + gh * gw, dim, device=device, dtype=dtype_in)
        if spec["mixer"] == "torch-mha":

            def call():
                return model(x, x, x, need_weights=False)[0]

        else:

            def call():
                return model(x, grid=(gh, gw))

    elif spec["kind"] == "matmul":  # the machine's dense matmul rate, the ceiling for every mixer
        size = int(spec.get("size", 2048))
        model = torch.nn.Linear(size, size, bias=False).to(device)  # holds B, so that params count it
        a = torch.randn(size, size, device=device, dtype=dtype_in)
        info["gflops_per_image"] = 2 * size**3 / 1e9

        def call():
            return torch.mm(a, model.weight)

    else:
        raise ValueError(f"unknown point kind {spec['kind']!r}")
    info["params"] = sum(p.numel() for p in model.parameters())
    return model, call, info


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up, time and measure one point; never raises (failures are a ``status``)."""
    import torch

    from ssogvit.bench import memory

    result: dict[str, Any] = {"status": "ok"}
    stage = "setup"
    try:
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        if spec.get("flush_denormal"):
            torch.set_flush_denormal(True)
        device = torch.device(spec.get("device", "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but CUDA is not available")
        torch.manual_seed(int(spec.get("seed", 0)))
        torch.mm(torch.ones(512, 512), torch.ones(512, 512))  # start the thread pool before any cap
        cap = spec.get("mem_cap_mib")
        if cap:
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**20 / total), device)
            else:
                memory.limit_arenas(2)  # each malloc arena reserves 64 MiB of address space, which the cap counts
                memory.cap_address_space(float(cap))
            result["mem_cap_mib"] = cap

        precision = spec.get("dtype", "fp32")
        amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        train = spec.get("mode", "inference") == "train"
        stage = "build"
        model, forward, info = _build(spec, device, torch.float32)
        result.update(info)
        model.train(train)

        def step():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                out = forward()
            if train:
                out.float().mean().backward()
                for p in model.parameters():
                    p.grad = None
                return None
            return out

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        grad_ctx = torch.enable_grad if train else torch.inference_mode
        with grad_ctx():
            stage = "warm-up"
            for _ in range(int(spec.get("warmup", 10))):
                step()
            sync()
            stage = "timing"
            times = []
            for _ in range(int(spec.get("iters", 50))):
                t0 = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - t0)
            stage = "memory"
            if spec.get("measure_memory", True):
                if device.type == "cuda":
                    result.update(memory.cuda_peak_call(step, device))
                else:
                    result.update(memory.cpu_peak_call(step))
                    if spec.get("torch_memory"):
                        result.update(memory.torch_peak_call(step))
        if times:
            total = sum(times)
            batch = int(spec["batch"])
            result.update(
                time_ms_mean=1e3 * total / len(times),
                time_ms_median=1e3 * statistics.median(times),
                time_ms_min=1e3 * min(times),
                time_ms_std=1e3 * (statistics.stdev(times) if len(times) > 1 else 0.0),
                images_per_s=batch * len(times) / total,
            )
            gf = result.get("gflops_per_image")
            if gf:
                result["achieved_gflops_per_s"] = gf * batch * len(times) / total
    except BaseException as exc:  # noqa: BLE001 - a point's failure is its result
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["status"] = "oom" if _is_oom(exc) else "error"
        result["error"] = f"{stage}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-2000:]
    for key, value in list(result.items()):
        if isinstance(value, float) and not math.isfinite(value):
            result[key] = None
    return result


def main() -> int:
    spec = json.loads(sys.stdin.read())
    result = run(spec)
    sys.stdout.write("\n" + RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
