"""Checkpoints and exported weights: read safely, written atomically, each with a digest of its contents.

Two formats hold a trained model:

- a Lightning checkpoint `*.ckpt` (`<output_dir>/checkpoints/{last,best,epoch=...}.ckpt`): weights, optimizer,
  scheduler and loop state; its hyper-parameters hold the model's config dict;
- an export `*.safetensors` (`<output_dir>/export/model.safetensors`, and `model_ema.safetensors` with EMA), sealed:
  the config in its header, which is the one that holds, and a readable copy beside it (`model.json`), checked
  against the header and refused if it differs (`ssogvit.models.sealed`).

Both are read without executing code from the file: checkpoints with `torch.load(weights_only=True)`, exports with
`safetensors`. Both carry a SHA-256 digest of all their contents (`content_digest`: a checkpoint's whole dict, an
export's tensors and header), written with them and checked on every load (and so before every resume): a file that
fails it is refused, naming the file, and never loaded; a file without one loads with an `UnverifiedFileWarning`. The
model is rebuilt from the config, checked first (`ssogvit.models.check_model_config`), with
`ssogvit.models.create_model`; weights that are not finite are refused.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssogvit.documents import MAX_PARAMETERS, input_file, read_document
from ssogvit.errors import InputError
from ssogvit.resources import check_device
from ssogvit.models import check_model_config, create_model, list_models, timm_name
from ssogvit.models.registry import weights_path
from ssogvit.models.sealed import (COPY_KEY, DIGEST_KEY, UnverifiedFileWarning, WeightsFileError, content_digest,
                                   file_config, seal, verify)
from ssogvit.outputs import (OutputExistsError, atomic_write, check_output_file, check_output_folder,
                             check_replaceable)

from .errors import CheckpointError, NonFiniteError

__all__ = [
    "CheckpointError", "build_model", "count_parameters", "load_model", "read_checkpoint", "read_state_dict",
    "read_model_config", "read_sealed", "sealed_data_config", "check_checkpoint", "holds_ema_weights",
    "export_safetensors", "list_checkpoints", "atomic_checkpoint_io", "atomic_write",
    "content_digest", "DIGEST_KEY", "MAX_PARAMETERS", "checkpoint_files",
]

def _check_digest(contents: Mapping[str, Any], recorded: Any, path: Path) -> None:
    if recorded is None:  # written before digests, or not by ssogvit's writers: nothing to compare
        warnings.warn(UnverifiedFileWarning(f"{path} carries no ssogvit digest: its contents are loaded unverified"),
                      stacklevel=3)
        return
    body = {k: v for k, v in contents.items() if k != DIGEST_KEY}
    if recorded != content_digest(body):
        raise CheckpointError(f"{path} fails its integrity check (the SHA-256 digest written with it does not match "
                              f"its contents): the file was changed or damaged after it was written, and was not "
                              f"loaded{_others(path)}")


def _others(path: Path) -> str:
    others = [str(p) for p in list_checkpoints(path.parent) if p.resolve() != path.resolve()]
    return f"; other checkpoints in {path.parent}: {others}" if others else ""


def _checkpoint_file(path: str | Path, what: str = "checkpoint") -> Path:
    """`path` if it is a readable file; a `CheckpointError` that names a folder as a folder (and, for a run folder,
    the files in it that hold weights)."""
    p = Path(path).expanduser()
    try:
        return input_file(p, what, what=what)
    except InputError as err:
        hint = ""
        if p.is_dir():
            found = [q for q in (p / "checkpoints" / "best.ckpt", p / "export" / "model.safetensors") if q.is_file()]
            hint = f"; give a file in it, e.g. {found[0]}" if found else "; give a .ckpt or .safetensors file"
        raise CheckpointError(f"{str(err).removeprefix(f'{what}: ')}{hint}") from None


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in `folder`, oldest first."""
    folder = Path(folder)
    return sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    mmap: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, loaded with `weights_only=True` and its digest checked; `CheckpointError`
    if it is missing, a folder, unreadable, damaged or not ours (`map_location` must be a device this machine has).

    Args:
        mmap: map the tensors from the file instead of reading them (a cheap look at a large checkpoint).
    """
    path = _checkpoint_file(path)
    try:
        check_device(map_location, "map_location")
    except InputError as err:
        raise CheckpointError(f"cannot load {path}: {err}") from None
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, bad pickle, disallowed global, ...
        refused = re.search(r"GLOBAL (\S+)", str(err))
        if not refused and _is_text(path):
            raise CheckpointError(f"{path} is a text file, not a checkpoint: expected a Lightning .ckpt, an exported "
                                  ".safetensors or a save_pretrained folder") from None
        if isinstance(err, pickle.UnpicklingError) and (refused or "Weights only load failed" in str(err)):
            # torch's own text suggests retrying with weights_only=False; a file that needs it is not ours to run
            what = f"it asks to run {refused.group(1)}" if refused else "it holds objects other than tensors and data"
            raise CheckpointError(f"refused to load {path}: {what}, which a safe (weights-only) load never executes; "
                                  f"this file was not written by ssogvit. It was left in place{_others(path)}."
                                  ) from None
        raise CheckpointError(
            f"cannot read checkpoint {path} ({path.stat().st_size} bytes): it is truncated or corrupt "
            f"({type(err).__name__}). It was left in place{_others(path)}."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    _check_digest(ckpt, ckpt.get(DIGEST_KEY), path)
    return ckpt


def _is_text(path: Path) -> bool:
    """Whether the file starts as text (a config, a log) rather than as any binary checkpoint could."""
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        return b"\0" not in head and bool(head.decode("utf-8").strip())
    except UnicodeDecodeError:
        return False


def check_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` unless `path` is a readable checkpoint with a model config."""
    _config_from_ckpt(read_checkpoint(path), path)


def _config_from_ckpt(ckpt: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    hp = ckpt.get("hyper_parameters") or {}
    if not isinstance(hp, Mapping) or not isinstance(hp.get("model_config"), Mapping):
        raise CheckpointError(f"{path} has no model_config in its hyper-parameters: not an ssogvit checkpoint")
    return _file_model_config(dict(hp["model_config"]), path)


def checkpoint_files(path: str | Path) -> list[Path]:
    """Every file a load of `path` reads or stands on: the file, the readable copies of its config beside it
    (`model.json`, a saved folder's `config.json`) and, for a file in a run folder (`checkpoints/`, `export/`), the
    run's `config.yaml` and `run.json`. A command's output may be none of them (`check_output_file(inputs=...)`)."""
    p = weights_path(path)
    files = [p, p.with_suffix(".json"), p.parent / "config.json"]
    if p.parent.name in ("checkpoints", "export"):
        files += [p.parent.parent / "config.yaml", p.parent.parent / "run.json"]
    return files


def _export_meta(path: Path) -> tuple[dict[str, Any], Path | None]:
    """The JSON beside an export (`model.json`, or `config.json` of a saved folder) and where it was, if any."""
    for side in (path.with_suffix(".json"), path.parent / "config.json"):
        if side.is_file():
            try:
                meta = read_document(side, "export config")
            except InputError as err:
                raise CheckpointError(f"cannot read the config of {path}: {err}") from None
            if not isinstance(meta, dict):
                raise CheckpointError(f"{side} holds no model_config object")
            return meta, side
    return {}, None


def _safetensors_header(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
        raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {str(err).splitlines()[0]}): it is "
                              "truncated or corrupt") from None


def _read_export_config(path: Path, header: Mapping[str, str] | None = None, *, ours: bool = True) -> dict[str, Any]:
    """The model config of a `.safetensors` file: the one sealed in its header, checked against the readable copy
    beside it (`ssogvit.models.sealed.file_config`; the copy alone only for a file whose header holds none), and,
    with `ours`, checked as a model of ours (`check_model_config`)."""
    meta, side = _export_meta(path)
    header = _safetensors_header(path) if header is None else header
    try:
        config = file_config(path, header, None if side is None else (meta, side),
                             {timm_name(n): n for n in list_models()})
    except WeightsFileError as err:
        raise CheckpointError(str(err)) from None
    return _file_model_config(config, path) if ours else config


def build_model(model_config: Mapping[str, Any]) -> nn.Module:
    """`create_model(**model_config)`; the dict is what a model's `.config` holds (its name and keyword args)."""
    return create_model(**model_config)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def _file_model_config(config: Any, source: str | Path) -> dict[str, Any]:
    """`config` of a checkpoint or export checked by `ssogvit.models.check_model_config` (the one validator of model
    configs read from files); a refusal is the file's `CheckpointError`."""
    try:
        return check_model_config(config, source=source)
    except InputError as err:
        raise CheckpointError(str(err)) from None


def _is_ema_export(path: Path, meta: Mapping[str, Any]) -> bool:
    return meta.get("weights") == "ema" or path.stem.endswith("_ema")


def holds_ema_weights(path: str | Path, *, use_ema: bool = False) -> bool:
    """Whether what `load_model(path, use_ema=use_ema)` loads are EMA weights: asked for, or an EMA export."""
    path = weights_path(path)
    return use_ema or (path.suffix == ".safetensors" and _is_ema_export(path, _export_meta(path)[0]))


def read_state_dict(path: str | Path, *, use_ema: bool = False,
                    map_location: str | torch.device = "cpu") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The model's weights and its config dict from a `.ckpt` or a `.safetensors` export, digests checked.

    Args:
        use_ema: take the EMA weights: from a checkpoint trained with EMA, or an EMA export (`model_ema.safetensors`);
            an export of the raw weights is refused, naming the EMA export beside it.
    """
    path = weights_path(path)
    if path.suffix != ".safetensors":
        ckpt = read_checkpoint(path, map_location)
        config = _config_from_ckpt(ckpt, path)
        hp = ckpt.get("hyper_parameters") or {}
        check_run_config_yaml(path, hp.get("data") if isinstance(hp.get("data"), dict) else None, config)
        prefix = "ema.module." if use_ema else "model."
        state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
        if not state:
            raise CheckpointError(f"{path} has no weights under {prefix!r}" + (" (trained without EMA?)" if use_ema
                                                                             else ""))
        return state, config
    path = _checkpoint_file(path, "export")
    try:
        check_device(map_location, "map_location")
    except InputError as err:
        raise CheckpointError(f"cannot load {path}: {err}") from None
    meta, _ = _export_meta(path)
    if use_ema and not _is_ema_export(path, meta):
        ema = path.with_name(f"{path.stem}_ema.safetensors")
        where = (f"its EMA weights are in {ema}" if ema.is_file()
                 else "no EMA export is beside it (trained without EMA?)")
        raise CheckpointError(f"use_ema=True: {path} holds the raw weights of a run, not its EMA weights; {where}")
    state, config = read_sealed(path, map_location)
    record = json.loads(_safetensors_header(path).get(COPY_KEY) or "null")
    data = record.get("data") if isinstance(record, dict) else None
    check_run_config_yaml(path, data if isinstance(data, dict) else None, config)
    return state, config


def read_sealed(path: str | Path, map_location: str | torch.device = "cpu", *, ours: bool = True
                ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors and the config of a sealed `.safetensors` export, its digest and the readable copy beside it
    checked (`ssogvit.models.sealed`): the config is the header's, never the copy's. `ours=False` for a config that
    is not a model of ours (a converted timm ViT's recipe, `ssogvit.convert.load_converted`)."""
    path = _checkpoint_file(path, "export")
    header = _safetensors_header(path)
    config = _read_export_config(path, header, ours=ours)
    from safetensors.torch import load_file

    try:
        state = load_file(str(path), device=str(map_location))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    try:
        verify(state, header, path)
    except WeightsFileError as err:
        raise CheckpointError(f"{err}{_others(path)}") from None
    return state, config


def sealed_data_config(path: str | Path) -> dict[str, Any] | None:
    """The data settings a model's run was trained with, as sealed with the model: an export's the `data` of the
    readable copy sealed in its header (`COPY_KEY`, under the digest; `model.json` beside it is checked against it,
    never read in its place), a checkpoint's its `data` hyper-parameter (under its digest). None for a file without
    them (the run's `config.yaml` is then the only record). The run's `config.yaml` beside the file, when there is
    one, must describe the same model and hold the same data but for where the data are and how they are loaded
    (`IGNORED_KEYS`, which a resume may change too, taken from it): one edited otherwise is refused, naming the key
    (an edited split would score training images as validation)."""
    p = weights_path(path)
    model = None
    if p.suffix == ".safetensors":
        record = sealed_record(p)
        if record is None and not p.with_suffix(".json").is_file():
            return None
        if record is None:  # a file sealed before its readable copy was: the digest at least
            read_sealed(p, ours=False)
        data, where = (record if record is not None else _export_meta(p)[0]).get("data"), p
        model = (record or {}).get("model_config")
        if record is None and data is not None:
            warnings.warn(UnverifiedFileWarning(
                f"{p} was written before ssogvit sealed a run's data settings with its weights: the data settings "
                f"(split, image size, normalisation) are read from {p.with_suffix('.json')}, unverified"),
                stacklevel=2)
    elif p.suffix == ".ckpt":
        hp = read_checkpoint(p, mmap=True).get("hyper_parameters") or {}
        data, where, model = hp.get("data"), p, hp.get("model_config")
        if data is None:
            warnings.warn(UnverifiedFileWarning(
                f"{p} was written before ssogvit sealed a run's data settings with its weights: the data settings "
                "(split, image size, normalisation) are read from the run config, unverified"), stacklevel=2)
    else:
        return None
    if data is not None and not isinstance(data, dict):
        raise CheckpointError(f"{where}: its data config is not a mapping")
    return check_run_config_yaml(p, data, model)


def check_run_config_yaml(p: Path, data: dict[str, Any] | None, model: Any) -> dict[str, Any] | None:
    """`data` with the run's `config.yaml` beside the file `p` checked against the file's own record (`data`,
    `model`): refused (`CheckpointError`, naming the key) where it describes another model or other data but for
    where the data are and how they load (`IGNORED_KEYS`, taken from it). Every loader of a file in a run folder runs
    it (`sealed_data_config`, `load_model`)."""
    run_config = p.parent.parent / "config.yaml"
    if p.parent.name in ("checkpoints", "export") and run_config.is_file():
        from .run_folder import IGNORED_KEYS, config_diff

        document = read_document(run_config, "the run's config.yaml")
        document = document if isinstance(document, dict) else {}
        recorded = document.get("data")
        differ = ([] if data is None else ["config.yaml has no data section"] if not isinstance(recorded, dict)
                  else config_diff({"data": data}, {"data": recorded}, labels=(p.name, "config.yaml")))
        differ = differ or (_model_differs(model, document.get("model"), p) if _run_command(p) == "train" else [])
        if differ:
            raise CheckpointError(f"{run_config} was changed since {p} was written ({differ[0]}): the file's own "
                                  f"record holds; restore the run's config.yaml")
        if data is not None:
            moved = {k[len("data."):] for k in IGNORED_KEYS if k.startswith("data.")} & set(recorded or {})
            data = {**data, **{k: recorded[k] for k in moved}}
    return data


def _run_command(p: Path) -> str | None:
    """The command whose run folder holds the file `p` (its `run.json`): a `train` run's config.yaml describes its
    model; a `transfer` or `convert` run's model is its source's or teacher's, which its config.yaml does not hold."""
    try:
        state = json.loads((p.parent.parent / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return state.get("command") if isinstance(state, dict) else None


def sealed_record(path: Path) -> dict[str, Any] | None:
    """The readable copy sealed in an export's header (`COPY_KEY`), the digest and the copy beside it checked
    (`read_sealed`); None for a file sealed without it."""
    copy = _safetensors_header(path).get(COPY_KEY)
    if copy is None:
        return None
    read_sealed(path, ours=False)
    record = json.loads(copy)
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: its sealed record is not a mapping")
    return record


def _model_differs(model: Any, section: Any, path: Path) -> list[str]:
    """`config_diff` of a file's model config and the model its run's `config.yaml` describes (`model.name` and the
    set `model.kwargs`, in the form the model records them); nothing to compare where either is missing or the file's
    is not a model of ours by name (a converted timm student)."""
    from .run_folder import config_diff

    if not isinstance(model, Mapping) or "name" not in model:
        return []
    if not isinstance(section, Mapping):
        return ["config.yaml has no model section"]
    kwargs = section.get("kwargs") if isinstance(section.get("kwargs"), Mapping) else {}
    parts = [section.get(k) for k in ("family", "size", "mixer")]
    if all(isinstance(x, str) for x in parts) and "-".join(parts) != model["name"]:  # what a report labels runs by
        return [f"model.family, size, mixer: {path.name} {model['name']!r}, config.yaml {'-'.join(parts)!r}"]
    described = {"name": section.get("name"), **{k: v for k, v in kwargs.items() if v is not None}}
    given = set(described)  # a null kwarg is the data's or the model's default: the run filled it, not config.yaml
    try:
        described = _file_model_config(described, "config.yaml")
    except CheckpointError as err:
        return [f"model: {err}"]
    return config_diff({"model": json.loads(json.dumps({k: v for k, v in dict(model).items() if k in given},
                                                       default=str))},
                       {"model": json.loads(json.dumps({k: v for k, v in described.items() if k in given},
                                                       default=str))}, labels=(path.name, "config.yaml"))


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The config dict (`create_model(**config)`) of a checkpoint or export."""
    path = weights_path(path)
    if path.suffix == ".safetensors":
        return _read_export_config(_checkpoint_file(path, "export"))
    return _config_from_ckpt(read_checkpoint(path), path)


def _check_finite(state: Mapping[str, Tensor], path: Path) -> None:
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(f"{path} holds non-finite weights in {len(bad)} tensor(s) ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}): the run it comes from diverged; it was not loaded")


def load_model(path: str | Path, map_location: str | torch.device = "cpu", *, use_ema: bool = False) -> nn.Module:
    """Rebuild a trained model from a Lightning `.ckpt`, an exported `.safetensors` (config beside it) or a
    `save_pretrained` folder (`weights_path`).

    Nothing from the file is executed: the checkpoint is read with `weights_only=True`, its digest checked, the
    config checked (`check_model_config`), the model built by `create_model(**config)` and the weights (all finite)
    loaded strictly. Returns the model in eval mode.

    Raises:
        CheckpointError: a missing, damaged or foreign file, a folder, a device this machine lacks, `use_ema` on an
            export of the raw weights, weights that do not fit the config.
        NonFiniteError: weights holding NaN or infinity.
    """
    path = weights_path(path)
    state, config = read_state_dict(path, use_ema=use_ema, map_location=map_location)
    _check_finite(state, path)
    model = build_model(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {path} do not fit the model {config.get('name')}: "
                              f"{str(err).splitlines()[0]}") from None
    return model.to(map_location).eval()


def atomic_checkpoint_io():
    """A Lightning `CheckpointIO` that writes each checkpoint atomically (temporary file in the same folder + rename)
    with the digest of its contents (`content_digest`), and checks that digest whenever Lightning loads one.

    Lightning's own save goes through a temporary file in the system temp folder, which is only renamed atomically
    when that folder is on the same file system as the checkpoints; this one always is.
    """
    from lightning.pytorch.plugins import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
            body = {k: v for k, v in checkpoint.items() if k != DIGEST_KEY}
            sealed = {**body, DIGEST_KEY: content_digest(body)}
            atomic_write(Path(path), lambda tmp: torch.save(sealed, tmp), overwrite=True)

        def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> Any:
            ckpt = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            if isinstance(ckpt, Mapping):
                _check_digest(ckpt, ckpt.get(DIGEST_KEY), Path(path))
            return ckpt

    return AtomicCheckpointIO()


def export_safetensors(model: nn.Module, path: str | Path, *, extra: Mapping[str, Any] | None = None,
                       overwrite: bool = False) -> Path:
    """Write `model`'s weights to `path` (`.safetensors`, sealed: its config in the header and one digest of the
    tensors and the header, `ssogvit.models.sealed`) and a readable copy of the config to the `.json` beside it,
    atomically. Both outputs are checked before anything is written (`ssogvit.outputs.check_output_file`: a run's
    folder holds its run's files only, and only regular files are replaced).

    Args:
        extra: more JSON-able facts to store beside the config (metrics, data normalisation, classes...).
        overwrite: replace files that exist; without it an existing file is an `OutputExistsError` and nothing is
            written.
    """
    path = Path(path)
    if check_output_folder(path.parent, "path").exists():  # a folder to be created holds neither file yet
        for p in (path, path.with_suffix(".json")):
            check_output_file(p, "path", overwrite=overwrite, hint="overwrite=True")
    return write_export(model, path, extra=extra, overwrite=overwrite)


def write_export(model: nn.Module, path: Path, *, extra: Mapping[str, Any] | None = None,
                 overwrite: bool = False) -> Path:
    """`export_safetensors` without the run-folder rule: the writer of a run's own export (`ssogvit.train.run`), and
    of `export_safetensors` once its outputs are checked. Neither file is written unless both may be replaced."""
    from safetensors.torch import save_file

    for p in (path, path.with_suffix(".json")):
        check_replaceable(p, "path")
        if p.exists() and not overwrite:
            raise OutputExistsError(f"path: {p} exists; pass overwrite=True to replace it, or choose another file",
                                    argument="path")
    config = dict(model.config)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(f"refusing to export {path}: {len(bad)} tensors hold non-finite values ({bad[0]}, ...)")
    text = json.dumps({"model_config": config, **dict(extra or {})}, indent=2, default=str)
    # the header's config is the one that holds; model.json is a readable copy, sealed whole (its data and metrics
    # too: eval reads the data settings from it), so a loader refuses any entry of it that differs
    header = seal(state, config, {COPY_KEY: json.dumps(json.loads(text), sort_keys=True)})
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata=header), overwrite=overwrite)
    atomic_write(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(text), overwrite=overwrite)
    return path
