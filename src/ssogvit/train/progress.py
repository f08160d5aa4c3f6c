"""Progress output fit for where it goes: Lightning's bar on a terminal, plain lines in a file or a cluster log.

A progress bar redraws itself with `\\r` frames; written to a file every frame stays (hundreds of bytes a step). So
`progress.mode: auto` (the default, `ssogvit/conf/config.yaml`) draws the bar only when stdout is a terminal and
otherwise prints one line per epoch with the epoch's metrics (`progress.every_n_steps`: also every N steps) and the
time the run has left, as the bar shows it (docs/training.md, "What a run prints").
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["MODES", "resolve_mode", "LineProgress", "format_metrics", "format_duration", "lines_every"]

MODES = ("auto", "bar", "lines", "none")


def resolve_mode(mode: str, *, stream: Any = None) -> str:
    """`bar`, `lines` or `none` for a configured mode; `auto` is `bar` when `stream` (stdout) is a terminal."""
    if mode not in MODES:
        from .errors import ConfigError

        raise ConfigError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    stream = sys.stdout if stream is None else stream
    return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"


def format_metrics(metrics: dict[str, Any]) -> str:
    """`name value` pairs of the scalar metrics, sorted by name (`val/top1 91.2  val/loss 0.4123`)."""
    parts = []
    for key in sorted(metrics):
        value = metrics[key]
        value = float(value.item()) if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1 else value
        if isinstance(value, float) and math.isfinite(value):
            parts.append(f"{key} {value:.4g}")
    return "  ".join(parts)


def format_duration(seconds: float) -> str:
    """`45 s`, `12 min 05 s`, `3 h 07 min`: a duration as a person reads it."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def lines_every(total: int) -> int:
    """How many of `total` items between two progress lines: about ten lines in all."""
    return max(1, math.ceil(total / 10))


class LineProgress(Callback):
    """One line per training epoch with its metrics (and one every `every_n_steps` steps); never a `\\r` frame.

    Each line ends with the time the run has left: the wall time per optimizer step of this launch so far (validation
    included) times the steps still to go (`trainer.estimated_stepping_batches`). Printed by rank 0 only, flushed at
    once so that a cluster log shows it while the run goes on.
    """

    def __init__(self, *, every_n_steps: int = 0):
        self.every_n_steps = int(every_n_steps)
        self._epoch_start = time.perf_counter()
        self._last_step = -1  # with gradient accumulation several batches end on one optimizer step
        self._validated = False  # whether this epoch ran a validation (check_val_every_n_epoch)
        self._start: tuple[float, int] | None = None  # (time, step) when this launch began training

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = (time.perf_counter(), int(trainer.global_step))
        try:
            self._total = float(trainer.estimated_stepping_batches)  # the optimizer steps of the whole run
        except Exception:  # noqa: BLE001 - Lightning cannot always tell (an iterable without a length)
            self._total = math.inf

    def time_left(self, trainer: Any) -> str:
        """`, 3 min 10 s left` from the pace of this launch so far; empty before the first step or at the end."""
        total = getattr(self, "_total", math.inf)
        if self._start is None or not math.isfinite(total):
            return ""
        start, first = self._start
        done, step = trainer.global_step - first, trainer.global_step
        if done <= 0 or step >= total:
            return ""
        return f", {format_duration((time.perf_counter() - start) / done * (total - step))} left"

    def _print(self, trainer: Any, text: str) -> None:
        if trainer.is_global_zero:
            print(text, flush=True)

    def _epoch(self, trainer: Any) -> str:
        total = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        return f"epoch {trainer.current_epoch + 1}/{total}"

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._epoch_start = time.perf_counter()
        self._validated = False

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._validated = self._validated or not trainer.sanity_checking

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self._last_step = step
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            shown = f"  loss {float(loss):.4g}" if loss is not None else ""
            self._print(trainer, f"{self._epoch(trainer)}  step {step}  batch {batch_idx + 1}/"
                                 f"{trainer.num_training_batches}{shown}"
                                 + (f"  ({left[2:]})" if (left := self.time_left(trainer)) else ""))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        logged = trainer.callback_metrics
        metrics = {k: v for k, v in logged.items()
                   if not k.endswith("_step") and f"{k}_epoch" not in logged and not k.startswith("lr-")
                   and (self._validated or not k.startswith("val"))}  # no stale validation metrics
        self._print(trainer, f"{self._epoch(trainer)}  step {trainer.global_step}  {format_metrics(metrics)}  "
                             f"({time.perf_counter() - self._epoch_start:.1f} s{self.time_left(trainer)})")


def evaluation_batches(model: Any, loader: Any, *, device: Any, mode: str):
    """The validation loop of ``ssogvit eval``, shared by every task: for each batch of ``loader``, in inference mode,
    ``(index from 1, number of batches, targets, logits, whether a progress line is due)``; the bar is drawn when
    ``mode`` is ``bar`` (``resolve_mode``)."""
    import torch
    from tqdm import tqdm

    every = lines_every(len(loader))
    with torch.inference_mode():
        for i, (x, y) in enumerate(tqdm(loader, desc="eval", disable=mode != "bar", leave=False), 1):
            y = y.to(device)
            yield i, len(loader), y, model(x.to(device)), mode == "lines" and (i % every == 0 or i == len(loader))
