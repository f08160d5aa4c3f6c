"""A weights file's one source of truth: the safetensors header carries the model config, and one digest covers the
tensors and the whole header (docs/models.md, "Saved and exported weights").

A `.safetensors` file that ssogvit writes (`ssogvit.train.export_safetensors`, `model.save_pretrained`) is *sealed*:
its header holds `model_config` (the JSON `create_model(**config)` rebuilds the model from), `ssogvit_sealed` (what
the digest covers) and `ssogvit_digest`, the SHA-256 of every tensor and every other header entry. The JSON beside
it (`model.json` of an export, `config.json` of a saved folder) is a human-readable copy: it is checked against the
header and never preferred to it, so an edit of `depth` in `model.json` is refused, not obeyed. A file without a
digest (written by another tool, or before digests) loads with an `UnverifiedFileWarning` naming it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ssogvit.errors import UserError
from ssogvit.outputs import atomic_write

__all__ = [
    "DIGEST_KEY", "SEALED_KEY", "CONFIG_KEY", "COPY_KEY", "WeightsFileError", "UnverifiedFileWarning", "content_digest",
    "seal", "seal_file", "verify", "header_config", "side_config", "file_config",
]

#: where a checkpoint (and a weights file's header) keeps the digest of the rest of its contents
DIGEST_KEY = "ssogvit_digest"
#: header entry saying what the digest covers; absent in files written before the header was covered
SEALED_KEY = "ssogvit_sealed"
SEALED = "tensors+header"
#: header entry holding the model config as JSON
CONFIG_KEY = "model_config"
#: header entry holding, as JSON, the whole readable copy written beside the file (a saved folder's `config.json`,
#: whose `pretrained_cfg` (mean, std, input size) timm's data pipeline reads): a loader refuses a copy that differs
COPY_KEY = "ssogvit_readable_copy"


class WeightsFileError(UserError, ValueError):
    """A weights file whose contents do not match their digest, or whose readable copy of the config differs from
    the config in its header."""


class UnverifiedFileWarning(UserWarning):
    """A file loaded without a digest to check it against: its contents are whatever is on disk."""


def content_digest(obj: Any) -> str:
    """SHA-256 of a checkpoint's contents: every tensor's dtype, shape and bytes, and every plain value, walked in a
    fixed order (dict keys sorted), so the digest of what was saved equals that of what a load gives back."""
    h = hashlib.sha256()
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, Tensor):
            t = node.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(node.shape)}|".encode())
            h.update(memoryview(t.view(torch.uint8).numpy()))
        elif isinstance(node, Mapping):
            keys = sorted(node, key=lambda k: (type(k).__name__, repr(k)))
            h.update(f"D{len(keys)}|".encode())
            for key in reversed(keys):  # popped in sorted order
                stack += [node[key], key]
        elif isinstance(node, (list, tuple)):
            h.update(f"{'L' if isinstance(node, list) else 'U'}{len(node)}|".encode())
            stack += reversed(node)
        else:
            h.update(f"{type(node).__name__}:{node!r}|".encode())
    return h.hexdigest()


def seal(state: Mapping[str, Tensor], config: Mapping[str, Any], metadata: Mapping[str, str] | None = None
         ) -> dict[str, str]:
    """The header of a sealed weights file: `metadata`, the model config and the digest of the tensors and all of it."""
    header = {**dict(metadata or {}), CONFIG_KEY: json.dumps(dict(config), sort_keys=True), SEALED_KEY: SEALED}
    header.pop(DIGEST_KEY, None)
    return {**header, DIGEST_KEY: content_digest({"tensors": dict(state), "header": header})}


def seal_file(path: str | Path, config: Mapping[str, Any], copy: Mapping[str, Any] | None = None) -> None:
    """Seal a safetensors file another writer made (timm's ``save_for_hf``) in place: same tensors, header `seal`ed,
    with `copy` (the readable document beside it, whole) under `COPY_KEY`. For a file in a staging folder
    (`ssogvit.outputs.staged_outputs`), not yet published."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    if copy is not None:
        metadata[COPY_KEY] = json.dumps(dict(copy), sort_keys=True)
    state = load_file(str(path))
    header = seal(state, config, metadata)
    atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata=header), overwrite=True)


def verify(state: Mapping[str, Tensor], header: Mapping[str, str], path: str | Path) -> None:
    """Check a weights file's tensors and header against its digest: `WeightsFileError` if they differ; an
    `UnverifiedFileWarning` if the file has no digest, or one written before it covered the header (then the tensors
    are checked and the config is named as unverified)."""
    recorded = header.get(DIGEST_KEY)
    if recorded is None and SEALED_KEY in header:  # sealed when written: its digest was taken out since
        raise WeightsFileError(f"{path} says it was sealed by ssogvit but its digest is missing: the file was changed "
                               "after it was written, and was not loaded")
    if recorded is None:
        warnings.warn(UnverifiedFileWarning(f"{path} carries no ssogvit digest: its weights and config are loaded "
                                            "unverified"), stacklevel=3)
        return
    rest = {k: v for k, v in header.items() if k != DIGEST_KEY}
    if header.get(SEALED_KEY) == SEALED:
        body: Any = {"tensors": dict(state), "header": rest}
    else:  # written before the digest covered the header: it covers the tensors only
        body = dict(state)
        warnings.warn(UnverifiedFileWarning(f"{path} was written before its digest covered the config: the weights "
                                            "are verified, the config is not (export it again to seal both)"),
                      stacklevel=3)
    if recorded != content_digest(body):
        raise WeightsFileError(f"{path} fails its integrity check (the SHA-256 digest written with it does not match "
                               "its contents): the file was changed or damaged after it was written, and was not "
                               "loaded")


def header_config(header: Mapping[str, str], path: str | Path) -> dict[str, Any] | None:
    """The model config in a weights file's header, or None if it holds none."""
    if CONFIG_KEY not in header:
        return None
    try:
        config = json.loads(header[CONFIG_KEY])
    except ValueError as err:
        raise WeightsFileError(f"cannot read the config of {path} ({type(err).__name__}: {err})") from None
    if not isinstance(config, dict):
        raise WeightsFileError(f"{path}: its header's model_config is not a JSON object")
    return config


def side_config(document: Any, side: Path, names: Mapping[str, str]) -> dict[str, Any]:
    """The model config a readable copy beside a weights file states: `model.json`'s `model_config` (an export), or
    a saved folder's `config.json` (`architecture`, a timm name of `names` -> ssogvit name, and its `model_args`)."""
    if isinstance(document, dict) and isinstance(document.get("model_config"), dict):
        return dict(document["model_config"])
    if isinstance(document, dict) and isinstance(document.get("model_args"), dict) and document.get(
            "architecture") in names:
        return {"name": names[document["architecture"]], **document["model_args"]}
    raise WeightsFileError(f"{side} holds no model config of ssogvit's (expected 'model_config', or an "
                           "'architecture' ssogvit_<family>_<size>_<mixer> and its 'model_args')")


def _normal(config: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(dict(config), sort_keys=True))  # tuples and lists alike, as JSON holds them


def file_config(path: str | Path, header: Mapping[str, str], side: tuple[Any, Path] | None,
                names: Mapping[str, str]) -> dict[str, Any]:
    """The model config of a weights file: its header's (the one source of truth), checked against the readable copy
    `side` (`(document, where)`) if there is one; the copy's alone only for a file whose header holds none. `names`
    maps timm names to ssogvit's (a saved folder's `config.json` names the timm architecture)."""
    own = header_config(header, path)
    if side is None:
        if own is None:
            raise WeightsFileError(f"no config for {path}: its header holds none and no model.json is beside it")
        return own
    sealed_copy = header.get(COPY_KEY)
    if sealed_copy is not None:  # the whole document was sealed: every entry of it must hold, not only the model's
        _refuse_differences(_flat(json.loads(sealed_copy)), _flat(_normal(side[0])), side[1], path)
    copy = side_config(*side, names)
    if own is None:
        warnings.warn(UnverifiedFileWarning(f"{path} holds no config of its own: the model is built from {side[1]}, "
                                            "unverified"), stacklevel=3)
        return copy
    _refuse_differences(_normal(own), _normal(copy), side[1], path)
    return own


def _flat(document: Any, prefix: str = "") -> dict[str, Any]:
    """A JSON document's entries by dotted key (`pretrained_cfg.mean`)."""
    if not isinstance(document, dict):
        return {prefix: document}
    out: dict[str, Any] = {}
    for key, value in document.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)) if isinstance(value, dict)
                   else {f"{prefix}.{key}" if prefix else str(key): value})
    return out


def _refuse_differences(sealed: Mapping[str, Any], copy: Mapping[str, Any], side: Path, path: str | Path) -> None:
    """Raise `WeightsFileError` naming the entries (up to three) where the readable copy `side` differs from what is
    sealed in `path`."""
    def text(entries: Mapping[str, Any], key: str) -> str:  # as JSON writes it: a NaN metric equals itself
        return json.dumps(entries.get(key, "(absent)"), sort_keys=True)

    keys = sorted(k for k in set(sealed) | set(copy) if text(sealed, k) != text(copy, k))
    if keys:
        shown = ", ".join(f"{k}: {copy.get(k, '(absent)')!r} in {side.name}, {sealed.get(k, '(absent)')!r} in the "
                          "weights" for k in keys[:3])
        raise WeightsFileError(f"{side} does not match the config sealed in {path} ({shown}): the readable copy was "
                               "edited or belongs to another file; the weights file's own config is the one that "
                               f"holds: restore {side.name} or export the model again")
