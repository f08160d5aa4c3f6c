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
import math
import os
import pickle
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssogvit.models import create_model, list_models

from .errors import CheckpointError

__all__ = [
    "CheckpointError", "build_model", "count_parameters", "load_model", "read_checkpoint", "read_state_dict",
    "read_model_config", "check_checkpoint",
    "check_model_config", "export_safetensors", "list_checkpoints", "atomic_checkpoint_io", "atomic_write",
    "MODEL_LIMITS", "MAX_PARAMETERS",
]

# Bounds a model config read from a file must respect before a model is built from it: generous for any real
# model (ViT-g/14 has 1.0e9 parameters), tight enough that a small file cannot make us allocate gigabytes.
MODEL_LIMITS: dict[str, tuple[float, float]] = {
    "embed_dim": (1, 8192), "num_heads": (1, 256), "depth": (1, 1024), "img_size": (1, 16384),
    "patch_size": (1, 1024), "num_classes": (0, 1_000_000), "in_chans": (1, 1024), "mlp_ratio": (0, 64),
    "num_registers": (0, 1024), "num_atoms": (1, 1024), "radius": (0, 1024),
}
MAX_PARAMETERS = 1_000_000_000


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in `folder`, oldest first."""
    folder = Path(folder)
    return sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    mmap: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, loaded with `weights_only=True`; `CheckpointError` if it is unreadable.

    Args:
        mmap: map the tensors from the file instead of reading them (a cheap look at a large checkpoint).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad pickle, disallowed global, ...
        others = [str(p) for p in list_checkpoints(path.parent) if p.resolve() != path.resolve()]
        hint = f"; other checkpoints in {path.parent}: {others}" if others else ""
        refused = re.search(r"GLOBAL (\S+)", str(err))
        if isinstance(err, pickle.UnpicklingError) and (refused or "Weights only load failed" in str(err)):
            # torch's own text suggests retrying with weights_only=False; a file that needs it is not ours to run
            what = f"it asks to run {refused.group(1)}" if refused else "it holds objects other than tensors and data"
            raise CheckpointError(f"refused to load {path}: {what}, which a safe (weights-only) load never executes; "
                                  f"this file was not written by ssogvit. It was left in place{hint}.") from None
        raise CheckpointError(
            f"cannot read checkpoint {path} ({path.stat().st_size} bytes): it is truncated or corrupt "
            f"({type(err).__name__}). It was left in place{hint}."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    return ckpt


def check_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` unless `path` is a readable checkpoint with a model config."""
    _config_from_ckpt(read_checkpoint(path), path)


def _config_from_ckpt(ckpt: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    hp = ckpt.get("hyper_parameters") or {}
    if not isinstance(hp, Mapping) or not isinstance(hp.get("model_config"), Mapping):
        raise CheckpointError(f"{path} has no model_config in its hyper-parameters: not an ssogvit checkpoint")
    return check_model_config(dict(hp["model_config"]), source=path)


def _read_export_config(path: Path) -> dict[str, Any]:
    try:
        for side in (path.with_suffix(".json"), path.parent / "config.json"):
            if side.is_file():
                meta = json.loads(side.read_text())
                config = meta.get("model_config", meta) if isinstance(meta, dict) else None
                if not isinstance(config, dict):
                    raise CheckpointError(f"{side} holds no model_config object")
                return check_model_config(config, source=side)
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "model_config" in meta:
            return check_model_config(json.loads(meta["model_config"]), source=path)
    except (ValueError, OSError) as err:  # bad JSON, unreadable header
        raise CheckpointError(f"cannot read the config of {path} ({type(err).__name__}: {err})") from None
    raise CheckpointError(f"no config for {path}: expected {path.with_suffix('.json')} beside it")


def build_model(model_config: Mapping[str, Any]) -> nn.Module:
    """`create_model(**model_config)`; the dict is what a model's `.config` holds (its name and keyword args)."""
    config = dict(model_config)
    if isinstance(config.get("steer"), list):
        config["steer"] = tuple(config["steer"])
    return create_model(**config)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def check_model_config(config: Any, *, source: str | Path = "the model config") -> dict[str, Any]:
    """`config` if it names a known model within `MODEL_LIMITS` and `MAX_PARAMETERS`; `CheckpointError` otherwise.

    Run on every config read from a file before a model is built from it: the parameter count is that of the model
    built on the meta device (shapes only, no memory).
    """
    if not isinstance(config, dict) or not isinstance(config.get("name"), str):
        raise CheckpointError(f"{source}: model_config must be a dict with a 'name', got {type(config).__name__}")
    if config["name"] not in list_models():
        raise CheckpointError(f"{source}: unknown model {config['name']!r} (see `ssogvit list models`)")
    for key, (low, high) in MODEL_LIMITS.items():
        value = config.get(key)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values if value is not None else []:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
                raise CheckpointError(f"{source}: model_config {key}={value!r} is outside the limits [{low}, {high}]")
    try:
        with torch.device("meta"):
            n = count_parameters(build_model(config))
    except (ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"{source}: model_config does not build: {str(err).splitlines()[0]}") from None
    if n > MAX_PARAMETERS:
        raise CheckpointError(f"{source}: model_config asks for {n:,} parameters ({4 * n / 1e9:.1f} GB in fp32), "
                              f"more than the limit of {MAX_PARAMETERS:,}")
    return config


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
    state, config = read_state_dict(path, use_ema=use_ema, map_location=map_location)
    model = build_model(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {path} do not fit the model {config.get('name')}: {err}") from err
    return model.to(map_location).eval()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write) -> None:
    """`write(tmp)` to a temporary file in `path`'s folder, flush it to disk, then rename it over `path`.

    The rename is atomic on a POSIX file system, so `path` holds either the old or the new content, never a mix, even
    if the process dies mid-write; the temporary file is removed on failure (a kill leaves `.<name>.*.tmp`, which
    the next launch into the run folder removes). The file gets the mode an ordinary `open` would give
    (`0o666` less the umask, where `mkstemp` alone gives 0600), and the folder is fsynced after the rename so the
    new name survives a power cut.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # after the write: a writer may replace the file (safetensors does)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
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
            atomic_write(Path(path), lambda tmp: torch.save(checkpoint, tmp))

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
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        from .errors import NonFiniteError

        raise NonFiniteError(f"refusing to export {path}: {len(bad)} tensors hold non-finite values ({bad[0]}, ...)")
    meta = {"model_config": config, **dict(extra or {})}
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata={"model_config": json.dumps(config)}))
    atomic_write(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2, default=str)))
    return path
