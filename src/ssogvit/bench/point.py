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

__all__ = ["is_oom", "make_step", "run"]

_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory", "bad_alloc")
_AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (PyTorch's CPU or CUDA out-of-memory error, ``MemoryError``)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def _build(spec: dict[str, Any], device: torch.device) -> tuple[torch.nn.Module, Callable[[], Any], torch.Tensor, dict]:
    """``(module, forward, x, info)``: ``forward()`` runs the module once on the input ``x``; ``info``: GFLOPs per
    image (``None`` for a mixer that does not count its FLOPs) and, for a model, its grid and tokens."""
    from ssogvit.bench.flops import count_flops, grid_of, mixer_flops

    batch, kind, info = int(spec["batch"]), spec["kind"], {}
    if kind == "model":
        from ssogvit.models import create_model

        res = int(spec["res"])
        module = create_model(spec["model"], img_size=res, **dict(spec.get("model_kwargs") or {})).to(device)
        gh, gw = grid_of(module, res)
        info.update(grid=[gh, gw], tokens=module.num_prefix_tokens + gh * gw, gflops=count_flops(module, res))
        x = torch.randn(batch, module.in_chans, res, res, device=device)
        forward = functools.partial(module, x)
    elif kind == "operator":
        from ssogvit.layers import create_mixer

        dim, heads, prefix, (gh, gw) = int(spec["dim"]), int(spec["heads"]), int(spec.get("prefix", 1)), spec["grid"]
        options, x = dict(spec.get("mixer_options") or {}), torch.randn(batch, prefix + gh * gw, dim, device=device)
        if spec["mixer"] == "torch-mha":
            module = torch.nn.MultiheadAttention(dim, heads, batch_first=True, **options).to(device)
            forward = functools.partial(module, x, x, x, need_weights=False)  # -> (output, None)
        else:
            module = create_mixer(spec["mixer"], dim, heads, **options).to(device)
            forward = functools.partial(module, x, grid=(gh, gw), num_prefix_tokens=prefix)
        with contextlib.suppress(TypeError):  # a mixer that does not count its FLOPs: timed and measured, no rates
            info["gflops"] = mixer_flops(module, (gh, gw), prefix)["total"]
    elif kind == "matmul":  # the machine's dense matmul rate, the ceiling for every mixer
        size = int(spec.get("size", 2048))
        module, x = torch.nn.Linear(size, size, bias=False).to(device), torch.randn(size, size, device=device)
        forward, info["gflops"] = functools.partial(torch.mm, x, module.weight), 2 * size**3
    else:
        raise ValueError(f"unknown point kind {kind!r}; expected 'model', 'operator' or 'matmul'")
    gflops = info.pop("gflops", None)
    return module, forward, x, info | {"gflops_per_image": None if gflops is None else gflops / 1e9}


def _autocast(device: torch.device, precision: str) -> torch.autocast:
    return torch.autocast(device.type, dtype=_AMP[precision], enabled=_AMP[precision] is not None)


def make_step(module: torch.nn.Module, forward: Callable[[], Any], *, device: torch.device, precision: str,
              train: bool) -> tuple[Callable[[], Any], torch.optim.Optimizer | None]:
    """One call of the point and its optimizer: inference (``torch.inference_mode``; no optimizer) or a whole training
    step (forward, the mean of the output as loss, backward, ``torch.optim.AdamW`` step, gradients set to ``None``)."""
    module.train(train)
    if not train:

        def infer():
            with torch.inference_mode(), _autocast(device, precision):
                return forward()

        return infer, None
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step():
        with _autocast(device, precision):
            out = forward()
            loss = (out[0] if isinstance(out, tuple) else out).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def _time(step: Callable[[], Any], *, iters: int, blocks: int, batch: int) -> dict[str, Any]:
    # the timer imports torch.utils.cpp_extension, whose "No CUDA runtime is found" (a CUDA toolkit, no GPU) is noise
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils.benchmark import Timer

    timer = Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    per_call = [timer.timeit(number=iters).mean for _ in range(blocks)]
    best = min(per_call)
    return dict(time_ms=1e3 * best, time_ms_blocks=[1e3 * t for t in per_call],
                time_ms_median=1e3 * statistics.median(per_call), time_ms_spread=(max(per_call) - best) / best,
                images_per_s=batch / best)


def _setup(spec: dict[str, Any], device: torch.device) -> None:
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if spec.get("flush_denormal"):
        torch.set_flush_denormal(True)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    torch.manual_seed(int(spec.get("seed", 0)))
    torch.mm(torch.ones(512, 512), torch.ones(512, 512))  # start the thread pool before any cap
    cap = spec.get("mem_cap_mib")
    if cap and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**20 / total), device)
    elif cap:
        memory.limit_arenas(2)  # each malloc arena reserves 64 MiB of address space, which the cap counts
        memory.cap_address_space(float(cap))


def _measure_memory(spec: dict[str, Any], step: Callable[[], Any], kept: list, forward: Callable[[], Any],
                    device: torch.device, train: bool) -> dict[str, Any]:
    """Peak memory of one ``step``; ``kept``: the module, its optimizer (or ``None``) and the input."""
    if device.type == "cuda":
        return memory.cuda_peak_call(step, device)
    how, out = spec.get("memory", "allocator"), {}
    if how in ("resident", "both"):
        rss = memory.cpu_peak_call(step)
        out.update(rss, rss_peak_mib=rss["peak_mib"])
    if how in ("allocator", "both"):
        # kineto logs "ERROR: ... gpuGetDeviceCount failed" on a CUDA build of torch without a GPU though only CPU
        # activity is asked for: this process is the point's own, so quiet it unless the user set the level
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        alloc = memory.torch_peak_call(step, kept=kept)
        method = "torch allocator (profiler memory events)" + ("; resident in rss_peak_mib" if how == "both" else "")
        out.update(alloc, peak_mib=alloc["torch_peak_mib"], memory_method=method)
    if train and spec.get("kind") == "model":
        with _autocast(device, spec.get("dtype", "fp32")):
            out.update(memory.saved_for_backward(kept[0], forward, exclude=[kept[-1]]))
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up, time and measure one point; never raises (failures are a ``status``)."""
    result, stage = {"status": "ok"}, "setup"
    try:
        device = torch.device(spec.get("device", "cpu"))
        _setup(spec, device)
        if spec.get("mem_cap_mib"):
            result["mem_cap_mib"] = spec["mem_cap_mib"]
        train = spec.get("mode", "inference") == "train"
        stage = "build"
        module, forward, x, info = _build(spec, device)
        result.update(info, params=sum(p.numel() for p in module.parameters()))
        if spec.get("compile"):
            forward = torch.compile(forward)
        step, opt = make_step(module, forward, device=device, precision=spec.get("dtype", "fp32"), train=train)
        stage = "warm-up"
        for i in range(int(spec.get("warmup", 10))):
            start = time.perf_counter()
            step()
            if i == 0 and spec.get("compile"):
                result["compile_s"] = time.perf_counter() - start
        if int(spec.get("iters", 50)) > 0:
            stage = "timing"
            result.update(_time(step, iters=int(spec.get("iters", 50)), blocks=int(spec.get("blocks", 3)),
                                batch=int(spec["batch"])))
            if result.get("gflops_per_image"):
                result["achieved_gflops_per_s"] = result["gflops_per_image"] * result["images_per_s"]
        if spec.get("measure_memory", True):
            stage = "memory"
            result.update(_measure_memory(spec, step, [module, opt, x], forward, device, train))
    except Exception as exc:  # a point's failure is its result
        result["status"] = "oom" if is_oom(exc) else "error"
        result["error"] = f"{stage}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-2000:]
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
