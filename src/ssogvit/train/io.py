"""Checkpoints and exported weights: read safely, write atomically.

Two formats hold a trained model:

- a Lightning checkpoint `*.ckpt` (`<output_dir>/checkpoints/{last,best,epoch=...}.ckpt`): weights, optimizer,
  scheduler and loop state; its hyper-parameters hold the model's config dict;
- an export `*.safetensors` (`<output_dir>/export/model.safetensors`, and `model_ema.safetensors` with EMA) with the
  config beside it as JSON (`model.json`) and also in the safetensors header.

Both are read without executing code from the file: checkpoints with `torch.load(weights_only=True)`, exports with
`safetensors`. The model is rebuilt from the config with `ssogvit.models.create_model`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "CheckpointError", "load_model", "read_checkpoint", "read_state_dict", "read_model_config", "check_checkpoint",
    "export_safetensors", "list_checkpoints", "atomic_checkpoint_io",
]


class CheckpointError(RuntimeError):
    """A checkpoint or export cannot be read (missing, truncated, corrupt, or not ours)."""


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in `folder`, oldest first."""
    folder = Path(folder)
    return sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A Lightning checkpoint as a dict, loaded with `weights_only=True`; `CheckpointError` if it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, disallowed global, ...
        others = [str(p) for p in list_checkpoints(path.parent) if p.resolve() != path.resolve()]
        hint = f"; other checkpoints in {path.parent}: {others}" if others else ""
        raise CheckpointError(
            f"cannot read checkpoint {path} ({path.stat().st_size} bytes): it is truncated or corrupt, or not a "
            f"weights-only checkpoint ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            f"It was left in place{hint}."
        ) from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    return ckpt


def check_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` unless `path` is a readable checkpoint with a model config."""
    _config_from_ckpt(read_checkpoint(path), path)


def _config_from_ckpt(ckpt: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    hp = ckpt.get("hyper_parameters") or {}
    if "model_config" not in hp:
        raise CheckpointError(f"{path} has no model_config in its hyper-parameters: not an ssogvit checkpoint")
    return dict(hp["model_config"])


def _read_export_config(path: Path) -> dict[str, Any]:
    for side in (path.with_suffix(".json"), path.parent / "config.json"):
        if side.is_file():
            meta = json.loads(side.read_text())
            return dict(meta.get("model_config", meta))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "model_config" in meta:
        return dict(json.loads(meta["model_config"]))
    raise CheckpointError(f"no config for {path}: expected {path.with_suffix('.json')} beside it")


def read_state_dict(path: str | Path, *, use_ema: bool = False,
                    map_location: str | torch.device = "cpu") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The model's weights and its config dict from a `.ckpt` or a `.safetensors` export.

    Args:
        use_ema: from a checkpoint trained with EMA, take the EMA weights.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise CheckpointError(f"export {path} does not exist")
        from safetensors.torch import load_file

        try:
            state = load_file(str(path), device=str(map_location))
        except Exception as err:
            raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err})") from err
        return state, _read_export_config(path)
    ckpt = read_checkpoint(path, map_location)
    config = _config_from_ckpt(ckpt, path)
    prefix = "ema.module." if use_ema else "model."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise CheckpointError(f"{path} has no weights under {prefix!r}" + (" (trained without EMA?)" if use_ema else ""))
    return state, config


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The config dict (`create_model(**config)`) of a checkpoint or export."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _read_export_config(path)
    return _config_from_ckpt(read_checkpoint(path), path)


def load_model(path: str | Path, map_location: str | torch.device = "cpu", *, use_ema: bool = False) -> nn.Module:
    """Rebuild a trained model from a Lightning `.ckpt` or an exported `.safetensors` (config beside it).

    Nothing from the file is executed: the checkpoint is read with `weights_only=True`, the model is built by
    `create_model(**config)` and the weights are loaded strictly. Returns the model in eval mode.
    """
    from .module import build_model

    state, config = read_state_dict(path, use_ema=use_ema, map_location=map_location)
    model = build_model(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {path} do not fit the model {config.get('name')}: {err}") from err
    return model.to(map_location).eval()


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` to a temporary file in `path`'s folder, flush it to disk, then rename it over `path`.

    The rename is atomic on a POSIX file system, so `path` holds either the old or the new content, never a mix, even
    if the process dies mid-write; the temporary file is removed on failure.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_checkpoint_io():
    """A Lightning `CheckpointIO` that writes each checkpoint atomically (temporary file in the same folder + rename).

    Lightning's own save goes through a temporary file in the system temp folder, which is only renamed atomically
    when that folder is on the same file system as the checkpoints; this one always is.
    """
    from lightning.pytorch.plugins import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
            _atomic_write(Path(path), lambda tmp: torch.save(checkpoint, tmp))

    return AtomicCheckpointIO()


def export_safetensors(model: nn.Module, path: str | Path, *, extra: Mapping[str, Any] | None = None) -> Path:
    """Write `model`'s weights to `path` (`.safetensors`) and its config to the `.json` beside it, atomically.

    Args:
        extra: more JSON-able facts to store beside the config (metrics, data normalisation, classes...).
    """
    from safetensors.torch import save_file

    path = Path(path)
    config = dict(model.config)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    meta = {"model_config": config, **dict(extra or {})}
    _atomic_write(path, lambda tmp: save_file(state, tmp, metadata={"model_config": json.dumps(config)}))
    _atomic_write(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2, default=str)))
    return path
