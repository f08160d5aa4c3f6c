"""Exact resume: which checkpoints a run may resume from, and the random state that goes with them.

A run can be resumed exactly only where its data order can be reproduced: at the end of a training epoch, where the
next epoch's shuffle, the loader workers' seeds, augmentation, mixup and drop path all draw from the torch, numpy and
Python random states saved with the checkpoint. `EpochEndCheckpoint` writes those (`last.ckpt`) and marks them
`"ssogvit": {"resumable": true}`; the module's `on_save_checkpoint` stores the random states in every checkpoint and
`on_load_checkpoint` restores them. Mid-epoch and validation-time checkpoints (`step=*.ckpt`, `best.ckpt`) are for
evaluation and transfer; `check_resumable` refuses them. See docs/training.md ("Resuming is exact").
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint

from ssogvit.documents import read_document

from .errors import CheckpointError
from .io import _config_from_ckpt, read_checkpoint
from .run_folder import EXTEND_KEYS, config_diff, resume_may_change

__all__ = ["EpochEndCheckpoint", "check_resumable", "rng_state", "save_resumable", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The torch (CPU and CUDA), numpy and Python random states, as tensors and plain data (weights-only loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_resumable(trainer: pl.Trainer, path: str | Path) -> None:
    """Save a checkpoint a resume may use (call it only at the end of a training epoch, or after `fit`)."""
    module = trainer.lightning_module
    module.saving_resumable = True
    try:
        trainer.save_checkpoint(path, weights_only=False)
    finally:
        module.saving_resumable = False


class EpochEndCheckpoint(Checkpoint):
    """Saves `path` (`last.ckpt`) at the end of every training epoch, after validation: the checkpoints that resume."""

    monitor = None

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        save_resumable(trainer, self.path)


def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def epochs_done(ckpt: Mapping[str, Any]) -> int:
    """How many training epochs a Lightning checkpoint holds: its fit loop's count of processed epochs (counted before
    the epoch-end hooks that save it; the `epoch` key is the epoch's index at an epoch's end but the count at the end
    of training), else `epoch + 1`."""
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("total", {})
    return int(progress.get("processed", int(ckpt.get("epoch", -1)) + 1))


def check_resumable(path: str | Path, model_config: dict[str, Any], *, recipe: Mapping[str, Any] | None = None,
                    config: Mapping[str, Any] | None = None, resume: Any = None) -> dict[str, Any]:
    """The checkpoint `path` as a dict if a run of `model_config` can resume from it exactly; `CheckpointError` if not.

    Only checkpoints taken at the end of a training epoch (`last.ckpt`) are resumable: there the data order and the
    random state of the next epoch are known. The tensors are memory-mapped, not read. The launch must be the
    checkpoint's run: its training recipe (`recipe`, the module's) must be the one the checkpoint records, and the
    launch's run config (`config`) the `config.yaml` of the run folder the checkpoint is in, but for what
    `resume_may_change(resume)` declares; a change would be recorded but not obeyed (the optimizer state restored
    from the checkpoint keeps the old learning rate).
    """
    path = Path(path)
    ckpt = read_checkpoint(path, mmap=True)
    if not (ckpt.get("ssogvit") or {}).get("resumable"):
        raise CheckpointError(f"{path} was not saved at the end of a training epoch (or by this version of ssogvit), "
                              f"so a resume from it cannot reproduce the data order; resume from "
                              f"{path.parent / 'last.ckpt'}, or start a new run from its weights with "
                              f"`ssogvit transfer --ckpt {path} --mode finetune`")
    saved = _config_from_ckpt(ckpt, path)  # in the model's one form, whatever version wrote it
    if _canonical(saved) != _canonical(model_config):
        a, b = _canonical(saved) or {}, _canonical(model_config)
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise CheckpointError(f"{path} holds another model (model_config differs in {', '.join(keys)}); resume it "
                              f"with the settings it was trained with, or write elsewhere with output_dir=<new folder>")
    if recipe is not None or config is not None:
        _check_same_run(ckpt, Path(path), recipe, config, resume)
    return ckpt


def _check_same_run(ckpt: Mapping[str, Any], path: Path, recipe: Mapping[str, Any] | None,
                    config: Mapping[str, Any] | None, resume: Any) -> None:
    """`CheckpointError` naming every setting in which the launch differs from the checkpoint's run (its recorded
    recipe, and the `config.yaml` of its run folder), but for what a resume may change."""
    may_change = resume_may_change(resume)
    diff: list[str] = []
    saved = (ckpt.get("hyper_parameters") or {}).get("recipe")
    if recipe is not None and isinstance(saved, Mapping):  # the checkpoint's own record, under its digest
        diff += config_diff(_as_run_config(saved), _as_run_config(recipe), may_change, labels=("run", "now"))
    run_config = path.parent.parent / "config.yaml"
    if config is not None and path.parent.name == "checkpoints" and run_config.is_file():
        recorded = read_document(run_config, "config.yaml")
        if isinstance(recorded, Mapping):
            diff += config_diff(recorded, config, may_change, labels=("run", "now"))
    diff = sorted(set(diff))
    if diff:
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        raise CheckpointError(f"resume={path} continues its run with that run's settings, but this launch changes "
                              f"them ({shown}); a resume may change only {', '.join(EXTEND_KEYS)} and where things "
                              f"are shown: drop the changes, or start a new try with resume=new")


def _as_run_config(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """A module's recipe under the run-config keys it comes from (`batch_size` is `data.batch_size`)."""
    out = _canonical(dict(recipe))
    if "batch_size" in out:
        out["data"] = {"batch_size": out.pop("batch_size")}
    return out
