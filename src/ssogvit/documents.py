"""Documents from disk: input files and folders, and the YAML and JSON documents that may come from someone else.

`input_file` and `input_folder` name what is wrong with a path (a folder is named as a folder, a missing file as
missing). Documents read from disk that may come from someone else (a run's `config.yaml`, `config.json` of a saved
model, the `model.json` of an export) go through `read_document`: a size bound, YAML without Python tags and with at
most `MAX_YAML_ALIASES` aliases, and no OmegaConf interpolation (`${oc.env:HOME}` is refused, never resolved or
printed). A model config from a file (there, or in a checkpoint's hyper-parameters) then goes through
`ssogvit.models.check_model_config`: a model of `list_models()`, its values within the declared ranges and at most
`MAX_PARAMETERS` parameters (docs/DEVELOPING.md, "How a command takes input and writes output").

This module imports the standard library, PyYAML and `ssogvit.errors` / `ssogvit.resources` only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ssogvit.errors import InputError, refused
from ssogvit.resources import format_bytes

__all__ = [
    "DocumentError", "input_file", "input_folder", "read_document", "parse_document", "check_no_interpolation",
    "MAX_DOCUMENT_BYTES", "MAX_YAML_ALIASES", "MAX_PARAMETERS",
]


class DocumentError(InputError):
    """A document read from disk (a config, a checkpoint's hyper-parameters) that may not be used as it is."""


def input_file(path: str | os.PathLike, argument: str, *, what: str = "file",
               suffixes: Sequence[str] | None = None) -> Path:
    """`path` as a `Path` if it is an existing, readable file; `InputError` naming `argument` otherwise (a folder
    is named as a folder, a missing file as missing)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise refused(argument, path, f"the path of a {what}", wrong_type=not isinstance(path, (str, os.PathLike)))
    p = Path(path).expanduser()
    if p.is_dir():
        raise InputError(f"{argument}: {p} is a folder, not a {what}", argument=argument)
    if not p.exists():
        raise InputError(f"{argument}: {p} does not exist", argument=argument)
    if not p.is_file():
        raise InputError(f"{argument}: {p} is not a regular file", argument=argument)
    if not os.access(p, os.R_OK):
        raise InputError(f"{argument}: {p} is not readable (permission denied)", argument=argument)
    if suffixes and p.suffix.lower() not in suffixes:
        raise InputError(f"{argument}: {p} is not a {what} (expected a name ending in {', '.join(suffixes)})",
                         argument=argument)
    return p


def input_folder(path: str | os.PathLike, argument: str) -> Path:
    """`path` as a `Path` if it is an existing, readable folder; `InputError` naming `argument` otherwise."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise refused(argument, path, "the path of a folder", wrong_type=not isinstance(path, (str, os.PathLike)))
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{argument}: the folder {p} does not exist", argument=argument)
    if not p.is_dir():
        raise InputError(f"{argument}: {p} is a file, not a folder", argument=argument)
    if not os.access(p, os.R_OK | os.X_OK):
        raise InputError(f"{argument}: the folder {p} is not readable (permission denied)", argument=argument)
    return p


MAX_DOCUMENT_BYTES = 1 << 20  # a config of ours is a few kB
MAX_YAML_ALIASES = 16  # a config of ours has none; 16 aliases expand a document a few hundred times at most
MAX_PARAMETERS = 1_000_000_000  # ViT-g/14 has 1.0e9 parameters


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python tags), refusing a document with more than `MAX_YAML_ALIASES` aliases."""

    aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise DocumentError(f"more than {MAX_YAML_ALIASES} YAML aliases (*name)")
        return super().compose_node(parent, index)


def check_no_interpolation(document: Any, source: str) -> None:
    """Refuse a document holding an OmegaConf interpolation (`${...}`) in any key or value (never resolved, never
    shown: it could read the environment or files); `DocumentError` naming the key."""
    stack: list[tuple[str, Any]] = [("", document)]
    seen: set[int] = set()  # a node reached twice (a YAML alias) is walked once
    while stack:
        where, node = stack.pop()
        if isinstance(node, (Mapping, list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
        if isinstance(node, Mapping):
            for key, value in node.items():
                stack.append((f"{where}.{key}" if where else str(key), value))
                if isinstance(key, str) and "${" in key:
                    stack.append((where or "<top>", key))
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))
        elif isinstance(node, str) and "${" in node:
            raise DocumentError(f"{source}: {where or '<top>'} holds an OmegaConf interpolation (${{...}}), which a "
                                "document read from disk may not use", argument=source)


def parse_document(text: str, source: str, *, json_only: bool = False) -> Any:
    """The YAML (or JSON) `text` of a document from `source`, under the bounds of `read_document`."""
    if len(text.encode(errors="replace")) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{source}: larger than {format_bytes(MAX_DOCUMENT_BYTES)}, far more than a config "
                            "holds", argument=source)
    try:
        if json_only:
            document = json.loads(text)
        else:
            loader = _BoundedLoader(text)
            try:
                document = loader.get_single_data()
            finally:
                loader.dispose()
    except DocumentError as err:
        raise DocumentError(f"{source}: {err}", argument=source) from None
    except (yaml.YAMLError, ValueError, RecursionError) as err:
        kind = "JSON" if json_only else "YAML"
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise DocumentError(f"{source}: not valid {kind} ({first})", argument=source) from None
    check_no_interpolation(document, source)
    return document


def read_document(path: str | os.PathLike, argument: str = "document") -> Any:
    """A YAML or JSON document (`.json`: JSON only) read from `path` that may come from someone else: at most
    `MAX_DOCUMENT_BYTES`, no Python tags, at most `MAX_YAML_ALIASES` aliases, no interpolation."""
    p = input_file(path, argument)
    if p.stat().st_size > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{p}: {format_bytes(p.stat().st_size)}, larger than the "
                            f"{format_bytes(MAX_DOCUMENT_BYTES)} a config may hold", argument=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DocumentError(f"{p}: not a text file (not UTF-8)", argument=str(p)) from None
    return parse_document(text, str(p), json_only=p.suffix.lower() == ".json")
