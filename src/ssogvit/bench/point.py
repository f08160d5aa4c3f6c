"""One benchmark point in a process of its own (docs/benchmarks.md, "How a point is run"): a dict, its ``kind``
(``"model"``, ``"operator"``, ``"matmul"``) and run options; ``run`` never raises: a failure is the row's ``status``."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ssogvit.bench import memory
from ssogvit.bench.flops import flops_breakdown, grid_of, mixer_flops
from ssogvit.layers import create_mixer
from ssogvit.models import create_model

__all__ = ["build", "make_step", "run"]

_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory", "bad_alloc")
_AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(spec: dict[str, Any], device: torch.device) -> tuple[torch.nn.Module, Callable[[], Any], torch.Tensor, dict]:
    """``(module, forward, x, info)``: ``forward()`` runs the module once on the input ``x``; ``info``: GFLOPs per
    image by the definition (``None`` for a mixer that does not count its FLOPs) and over the entries the C kernel
    reads (``gflops_read_per_image``: ``ssogvit.bench.flops.mixer_flops``' ``core_read``) and, for a model, its grid
    and tokens."""
    batch, kind, info, gflops = int(spec["batch"]), spec["kind"], {}, None
    if kind == "model":
        res = int(spec["res"])
        module = create_model(spec["model"], img_size=res, **dict(spec.get("model_kwargs") or {})).to(device)
        gh, gw = grid_of(module, res)
        parts = flops_breakdown(module, res)
        info = dict(grid=[gh, gw], tokens=module.num_prefix_tokens + gh * gw,
                    gflops_read_per_image=parts["total_read"] / 1e9)
        gflops = parts["total"]
        x = torch.randn(batch, module.in_chans, res, res, device=device)
        forward = functools.partial(module, x)
    elif kind == "operator":
        dim, heads, prefix, (gh, gw) = int(spec["dim"]), int(spec["heads"]), int(spec.get("prefix", 1)), spec["grid"]
        options, x = dict(spec.get("mixer_options") or {}), torch.randn(batch, prefix + gh * gw, dim, device=device)
        if spec["mixer"] == "torch-mha":
            module = torch.nn.MultiheadAttention(dim, heads, batch_first=True, **options).to(device)
            forward = functools.partial(module, x, x, x, need_weights=False)  # -> (output, None)
        else:
            module = create_mixer(spec["mixer"], dim, heads, **options).to(device)
            forward = functools.partial(module, x, grid=(gh, gw), num_prefix_tokens=prefix)
        with contextlib.suppress(TypeError):  # a mixer that does not count its FLOPs: timed and measured, no rates
            counted = mixer_flops(module, (gh, gw), prefix)
            gflops = counted["total"]
            info["gflops_read_per_image"] = (gflops - counted["core"] + counted["core_read"]) / 1e9
    elif kind == "matmul":  # the machine's dense matmul rate, the ceiling for every mixer
        size = int(spec.get("size", 2048))
        module, x = torch.nn.Linear(size, size, bias=False).to(device), torch.randn(size, size, device=device)
        forward, gflops = functools.partial(torch.mm, x, module.weight), 2 * size**3
    else:
        raise ValueError(f"unknown point kind {kind!r}; expected 'model', 'operator' or 'matmul'")
    return module, forward, x, info | {"gflops_per_image": None if gflops is None else gflops / 1e9}


def _autocast(device: torch.device, precision: str) -> torch.autocast:
    return torch.autocast(device.type, dtype=_AMP[precision], enabled=_AMP[precision] is not None)


def make_step(module: torch.nn.Module, forward: Callable[[], Any], *, device: torch.device, precision: str,
              train: bool) -> tuple[Callable[[], Any], torch.optim.Optimizer | None]:
    """One call of the point and its optimizer: inference (``torch.inference_mode``; no optimizer) or a whole training
    step (forward, the mean of the output as loss, backward, ``torch.optim.AdamW`` step, gradients set to ``None``)."""
    module.train(train)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4) if train else None

    def step():
        if not train:  # the output is returned: alive when the peak memory is read
            with torch.inference_mode(), _autocast(device, precision):
                return forward()
        with _autocast(device, precision):
            out = forward()
            loss = (out[0] if isinstance(out, tuple) else out).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up, time and measure one point; never raises (failures are a ``status``)."""
    result, stage = {"status": "ok"}, "setup"
    try:
        device, cap = torch.device(spec.get("device", "cpu")), spec.get("mem_cap_mib")
        train, precision = spec.get("mode", "inference") == "train", spec.get("dtype", "fp32")
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        if spec.get("flush_denormal"):
            torch.set_flush_denormal(True)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but CUDA is not available")
        torch.manual_seed(int(spec.get("seed", 0)))
        torch.mm(torch.ones(512, 512), torch.ones(512, 512))  # start the thread pool before any cap
        if cap and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**20 / total), device)
        elif cap:
            memory.cap_address_space(float(cap))
        else:  # a capped point is about memory; its address space is not spent on kept pages
            result["malloc_keeps_freed"] = memory.keep_freed_memory()
        if cap:
            result["mem_cap_mib"] = cap
        stage = "build"
        module, forward, x, info = build(spec, device)
        result.update(info, params=sum(p.numel() for p in module.parameters()))
        if spec.get("compile"):
            forward = torch.compile(forward)
        step, opt = make_step(module, forward, device=device, precision=precision, train=train)
        stage = "warm-up"
        for i in range(int(spec.get("warmup", 10))):
            start = time.perf_counter()
            step()
            if i == 0 and spec.get("compile"):
                result["compile_s"] = time.perf_counter() - start
        if (iters := int(spec.get("iters", 50))) > 0:
            stage = "timing"
            # the timer imports torch.utils.cpp_extension: "No CUDA runtime is found" (a CUDA toolkit, no GPU) is noise
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            from torch.utils.benchmark import Timer

            timer = Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
            per_call = [timer.timeit(number=iters).mean for _ in range(int(spec.get("blocks", 3)))]
            best = min(per_call)
            result.update(time_ms=1e3 * best, time_ms_blocks=[1e3 * t for t in per_call],
                          time_ms_median=1e3 * statistics.median(per_call),
                          time_ms_spread=(max(per_call) - best) / best, images_per_s=int(spec["batch"]) / best)
            if result.get("gflops_per_image"):
                result["achieved_gflops_per_s"] = result["gflops_per_image"] * result["images_per_s"]
        if spec.get("measure_memory", True):
            stage, how = "memory", "cuda" if device.type == "cuda" else spec.get("memory", "allocator")  # CPU: --memory
            mem = memory.cuda_peak_call(step, device) if how == "cuda" else {}
            if how in ("resident", "both"):
                rss = memory.cpu_peak_call(step)
                mem.update(rss, rss_peak_mib=rss["peak_mib"])
            if how in ("allocator", "both"):
                # kineto logs "ERROR: ... gpuGetDeviceCount failed" on a CUDA build of torch without a GPU though only
                # CPU activity is asked for: this process is the point's own, so quiet it unless the user set the level
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
                alloc = memory.torch_peak_call(step, kept=[module, opt, x])
                method = "torch allocator (profiler memory events)"
                mem.update(alloc, peak_mib=alloc["torch_peak_mib"],
                           memory_method=method + ("; resident in rss_peak_mib" if how == "both" else ""))
            if how != "cuda" and train and spec.get("kind") == "model":
                with _autocast(device, precision):
                    mem.update(memory.saved_for_backward(module, forward, exclude=[x]))
            result.update(mem)
    except Exception as exc:  # a point's failure is its result: "oom" for PyTorch's CPU or CUDA allocation failure
        oom = isinstance(exc, MemoryError | torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT))
        result["status"] = "oom" if oom else "error"
        result["error"] = f"{stage}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-2000:]
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
