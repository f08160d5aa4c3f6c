"""One way in: how every public constructor and every command checks what it is given, before it does any work.

An argument is declared once, as a `Spec` (`Int`, `Float`, `Choice`, `Flag`, `Text`, `IntOrPair`, `Ints`), and the
one declaration serves the three places a value comes from (docs/DEVELOPING.md, "How a command takes input and
writes output"):

- a constructor or function: its parameter is annotated `Annotated[int, IMG_SIZE]` and the function is wrapped with
  `@checked`, which checks every argument the caller passed;
- a command-line option: `parser.add_argument("--img-size", type=IMG_SIZE.argparse)`;
- a key of the Hydra run config: `ssogvit.train.config.RUN_CONFIG_RULES` maps `data.img_size` to `IMG_SIZE`.

A refused value raises `InputError` (a `ValueError`; `InputTypeError`, also a `TypeError`, for a value of the wrong
type) whose one-line message names the argument, the value and what was expected; the command line reports it as
`ssogvit <command>: <message>` with exit status 2 (`ssogvit.errors`).

Types are strict: an integer argument takes an `int`, a numpy integer or a 0-d integer tensor (exact integers,
what `operator.index` accepts, as Python's `range` and PyTorch's size arguments do) and refuses `224.5`, `224.0`
(a whole float usually comes from arithmetic such as `img_size / 2`; truncating it would hide that), `"224"` and
`True`. A float argument takes any real number but a bool, and refuses NaN and infinities unless declared.

Sizes: `check_memory` refuses a request whose estimated bytes exceed what this process may use (the least of the
physical memory, the cgroup limit and the room left under `RLIMIT_AS`), with the estimate, before anything is
allocated.

Documents read from disk that may come from someone else (a run's `config.yaml`, `config.json` of a saved model,
the `model.json` of an export) go through `read_document`: a size bound, YAML without Python tags and with at most
`MAX_YAML_ALIASES` aliases, and no OmegaConf interpolation (`${oc.env:HOME}` is refused, never resolved or printed).
A model config from a file (there, or in a checkpoint's hyper-parameters) goes through
`ssogvit.models.check_model_config`: a model of `list_models()`, its values within the declared ranges and at most
`MAX_PARAMETERS` parameters, checked by building it on the meta device (shapes only, no memory).

This module imports only the standard library, numpy, PyYAML and torch at module level: the layers and models use it.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import numbers
import operator
import os
import resource
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

__all__ = [
    "InputError", "InputTypeError", "DocumentError", "MemoryLimitError",
    "Spec", "Int", "Float", "Choice", "Flag", "Text", "IntOrPair", "Ints", "checked", "check_args",
    "input_file", "input_folder", "check_device",
    "memory_limit", "check_memory", "format_bytes",
    "read_document", "parse_document", "check_no_interpolation", "check_model_config",
    "MAX_DOCUMENT_BYTES", "MAX_YAML_ALIASES", "MAX_PARAMETERS",
    "IMG_SIZE", "PATCH_SIZE", "BATCH_SIZE", "NUM_CLASSES", "IN_CHANS", "NUM_WORKERS", "SEED",
    "EMBED_DIM", "NUM_HEADS", "DEPTH", "MLP_RATIO", "NUM_REGISTERS", "DROP_RATE",
]


class InputError(ValueError):
    """A value a constructor or a command refuses; the one-line message names the argument and what was expected.

    Attributes:
        argument: the argument's name as its caller wrote it (`img_size`, `--img-size`, `data.img_size`).
        expected: what would have been accepted (`an integer in [1, 16384]`), when the error is about one value.
    """

    def __init__(self, message: str, *, argument: str | None = None, expected: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument
        self.expected = expected


class InputTypeError(InputError, TypeError):
    """A value of the wrong type (`img_size=224.5`, `num_heads="4"`)."""


class DocumentError(InputError):
    """A document read from disk (a config, a checkpoint's hyper-parameters) that may not be used as it is."""


class MemoryLimitError(InputError):
    """A request whose estimated memory exceeds what this process may use; the message gives the estimate."""


# -- specs: one declaration per argument ---------------------------------------------------------------------------


def _refuse(name: str, value: Any, expected: str, *, wrong_type: bool = False) -> InputError:
    cls = InputTypeError if wrong_type else InputError
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return cls(f"{name}={shown}: expected {expected}", argument=name, expected=expected)


@dataclass(frozen=True)
class Spec:
    """How one argument is checked. `check(value, name)` returns the value (normalised: a numpy integer becomes an
    `int`) or raises `InputError`; `parse(text, name)` reads it from a command line first; `argparse` is the same
    as an argparse `type=`.

    Attributes:
        none: `None` (`null`, `none` on a command line) is accepted.
    """

    none: bool = field(default=False, kw_only=True)

    def expected(self) -> str:
        """What the argument accepts, in words (`an integer in [1, 16384]`)."""
        raise NotImplementedError

    def _expected(self) -> str:
        return self.expected() + (", or null" if self.none else "")

    def check(self, value: Any, name: str) -> Any:
        """`value` if it is acceptable (normalised), else `InputError` naming `name`."""
        if value is None:
            if self.none:
                return None
            raise _refuse(name, value, self._expected(), wrong_type=True)
        return self._check(value, name)

    def _check(self, value: Any, name: str) -> Any:
        raise NotImplementedError

    def parse(self, text: str, name: str) -> Any:
        """The value a command line's `text` stands for, checked."""
        if self.none and text.strip().lower() in ("none", "null"):
            return None
        return self.check(self._parse(text.strip(), name), name)

    def _parse(self, text: str, name: str) -> Any:
        return text

    @property
    def argparse(self) -> Callable[[str], Any]:
        """An argparse `type=`: a refused value is argparse's one-line usage error, `argument --x: expected ...`."""
        def convert(text: str) -> Any:
            try:
                return self.parse(text, "")
            except InputError as err:
                raise argparse.ArgumentTypeError(f"expected {err.expected or self._expected()}, got {text!r}") from None

        convert.__name__ = type(self).__name__.lower()
        return convert


def _range_words(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def _in_range(v: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    if low is not None and (v <= low if low_open else v < low):
        return False
    return not (high is not None and (v >= high if high_open else v > high))


def _as_int(value: Any) -> int | None:
    """`value` as an exact integer (an int, a numpy integer, a 0-d integer tensor), or None. Bools are not integers."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, torch.Tensor) and (value.ndim or value.is_floating_point() or value.is_complex()):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


@dataclass(frozen=True)
class Int(Spec):
    """An integer in `[low, high]` (either end may be open-ended: `None`), or one of `also` (e.g. `-1: unlimited`)."""

    low: int | None = None
    high: int | None = None
    also: tuple[int, ...] = ()

    def expected(self) -> str:
        words = " ".join(filter(None, ["an integer", _range_words(self.low, self.high, False, False)]))
        return words + "".join(f" or {v}" for v in self.also)

    def _check(self, value: Any, name: str) -> int:
        v = _as_int(value)
        if v is None:
            raise _refuse(name, value, self._expected(), wrong_type=True)
        if v not in self.also and not _in_range(v, self.low, self.high, False, False):
            raise _refuse(name, value, self._expected())
        return v

    def _parse(self, text: str, name: str) -> Any:
        try:
            return int(text, 10)
        except ValueError:
            return text  # refused by check, as the text it was


@dataclass(frozen=True)
class Float(Spec):
    """A real number in the range (open or closed ends); NaN and infinities only with `finite=False`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True

    def expected(self) -> str:
        words = " ".join(filter(None, ["a number", _range_words(self.low, self.high, self.low_open, self.high_open)]))
        return words if self.finite else words + " (inf allowed)"

    def _check(self, value: Any, name: str) -> float:
        if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool:
            value = value.item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise _refuse(name, value, self._expected(), wrong_type=True)
        v = float(value)
        if (self.finite and not math.isfinite(v)) or math.isnan(v):
            raise _refuse(name, value, self._expected())
        if not _in_range(v, self.low, self.high, self.low_open, self.high_open):
            raise _refuse(name, value, self._expected())
        return v

    def _parse(self, text: str, name: str) -> Any:
        try:
            return float(text)
        except ValueError:
            return text


@dataclass(frozen=True)
class Choice(Spec):
    """One of `choices` (compared exactly: `"Linear"` is not `"linear"`)."""

    choices: tuple[Any, ...] = ()

    def expected(self) -> str:
        return "one of " + ", ".join(map(repr, self.choices))

    def _check(self, value: Any, name: str) -> Any:
        if isinstance(value, bool) != any(isinstance(c, bool) for c in self.choices) or value not in self.choices:
            raise _refuse(name, value, self._expected(), wrong_type=not isinstance(value, str))
        return value


@dataclass(frozen=True)
class Flag(Spec):
    """A bool (`true`/`false` on a command line); `0` and `1` are not bools."""

    def expected(self) -> str:
        return "true or false"

    def _check(self, value: Any, name: str) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise _refuse(name, value, self._expected(), wrong_type=True)
        return bool(value)

    def _parse(self, text: str, name: str) -> Any:
        return {"true": True, "false": False}.get(text.lower(), text)


@dataclass(frozen=True)
class Text(Spec):
    """A string, not empty unless `empty`."""

    empty: bool = False

    def expected(self) -> str:
        return "a string" if self.empty else "a non-empty string"

    def _check(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise _refuse(name, value, self._expected(), wrong_type=True)
        if not self.empty and not value.strip():
            raise _refuse(name, value, self._expected())
        return value


@dataclass(frozen=True)
class IntOrPair(Spec):
    """An integer of `item`, or a pair `(H, W)` of them (an image size); returned as given (int or tuple)."""

    item: Int = Int()

    def expected(self) -> str:
        return f"{self.item.expected()}, or a pair (H, W) of them"

    def _check(self, value: Any, name: str) -> int | tuple[int, int]:
        if isinstance(value, (list, tuple)):
            if len(value) != 2:
                raise _refuse(name, value, self._expected(), wrong_type=True)
            try:
                return tuple(self.item.check(v, name) for v in value)
            except InputError as err:
                raise _refuse(name, value, self._expected(), wrong_type=isinstance(err, TypeError)) from None
        try:
            return self.item.check(value, name)
        except InputError as err:
            raise _refuse(name, value, self._expected(), wrong_type=isinstance(err, TypeError)) from None


@dataclass(frozen=True)
class Ints(Spec):
    """A list of at least `min_len` integers of `item` (`16,14,8` on a command line); returned as a list."""

    item: Int = Int()
    min_len: int = 1

    def expected(self) -> str:
        return f"a list of {self.min_len} or more of {self.item.expected()}".replace("of an integer", "integers")

    def _check(self, value: Any, name: str) -> list[int]:
        if not isinstance(value, (list, tuple)) or len(value) < self.min_len:
            raise _refuse(name, value, self._expected(), wrong_type=not isinstance(value, (list, tuple)))
        try:
            return [self.item.check(v, name) for v in value]
        except InputError as err:
            raise _refuse(name, value, self._expected(), wrong_type=isinstance(err, TypeError)) from None

    def _parse(self, text: str, name: str) -> Any:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return [self.item._parse(p, name) for p in parts]


def _specs_of(func: Callable) -> dict[str, Spec]:
    """The specs in `func`'s `Annotated[T, spec]` annotations (string annotations evaluated in its module)."""
    out = {}
    for param, hint in inspect.get_annotations(func).items():
        if isinstance(hint, str):
            if "Annotated[" not in hint:
                continue
            hint = eval(hint, func.__globals__)  # noqa: S307 - the function's own annotation, as typing does
        if typing.get_origin(hint) is typing.Annotated:
            specs = [m for m in hint.__metadata__ if isinstance(m, Spec)]
            if specs:
                out[param] = specs[0]
    return out


def checked(func: Callable) -> Callable:
    """Check, at every call, each argument the caller passed whose parameter is annotated `Annotated[T, spec]`.

    The wrapped function receives the normalised values (`np.int64(4)` arrives as `4`); a refused one raises
    `InputError` / `InputTypeError` naming the parameter. Defaults are not checked (they are the author's).
    """
    signature = inspect.signature(func)
    specs: dict[str, Spec] | None = None

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal specs
        if specs is None:  # on first use: the annotations may name what is defined after the function
            specs = _specs_of(func)
        bound = signature.bind(*args, **kwargs)
        for param, spec in specs.items():
            if param in bound.arguments:
                bound.arguments[param] = spec.check(bound.arguments[param], param)
        return func(*bound.args, **bound.kwargs)

    return wrapper


def check_args(specs: Mapping[str, Spec], values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` checked against `specs` (keys without a spec pass unchanged): the run config's way to use a table."""
    return {k: specs[k].check(v, k) if k in specs else v for k, v in values.items()}


# -- the arguments several surfaces share (a constructor, a command-line option and a run-config key) -------------

#: image side in pixels (`create_model(img_size=)`, `ssogvit eval --img-size`, `data.img_size`)
IMG_SIZE = Int(1, 16384)
#: square patch side in pixels
PATCH_SIZE = Int(1, 1024)
#: images per batch
BATCH_SIZE = Int(1, 1 << 20)
#: classes of the head (0: no head)
NUM_CLASSES = Int(0, 1_000_000)
#: image channels
IN_CHANS = Int(1, 1024)
#: data-loading worker processes
NUM_WORKERS = Int(0, 1024)
#: a random seed (numpy's range)
SEED = Int(0, 2**32 - 1)
#: token width D
EMBED_DIM = Int(1, 8192)
#: heads H
NUM_HEADS = Int(1, 256)
#: block applications (blocks, loop steps, ODE steps)
DEPTH = Int(1, 1024)
#: MLP hidden width over D
MLP_RATIO = Float(0, 64, low_open=True)
#: register tokens
NUM_REGISTERS = Int(0, 1024)
#: a dropout or drop-path probability
DROP_RATE = Float(0, 1, high_open=True)


# -- paths and devices ----------------------------------------------------------------------------------------------


def input_file(path: str | os.PathLike, argument: str, *, what: str = "file",
               suffixes: Sequence[str] | None = None) -> Path:
    """`path` as a `Path` if it is an existing, readable file; `InputError` naming `argument` otherwise (a folder
    is named as a folder, a missing file as missing)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise _refuse(argument, path, f"the path of a {what}", wrong_type=not isinstance(path, (str, os.PathLike)))
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
        raise _refuse(argument, path, "the path of a folder", wrong_type=not isinstance(path, (str, os.PathLike)))
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{argument}: the folder {p} does not exist", argument=argument)
    if not p.is_dir():
        raise InputError(f"{argument}: {p} is a file, not a folder", argument=argument)
    if not os.access(p, os.R_OK | os.X_OK):
        raise InputError(f"{argument}: the folder {p} is not readable (permission denied)", argument=argument)
    return p


def check_device(device: Any, argument: str = "device") -> torch.device:
    """`device` as a `torch.device` this machine has: `cuda` without CUDA is refused as such (not as a bad file)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise _refuse(argument, device, "a torch device such as 'cpu', 'cuda' or 'cuda:0'",
                      wrong_type=not isinstance(device, (str, torch.device))) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{argument}={str(device)!r}: CUDA is not available on this machine "
                             f"(torch.cuda.is_available() is False); use 'cpu'", argument=argument)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"{argument}={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s)", argument=argument)
    elif dev.type not in ("cpu", "meta", "mps") or (dev.type == "mps" and not torch.backends.mps.is_available()):
        raise InputError(f"{argument}={str(device)!r}: expected 'cpu' or 'cuda' (a device this machine has)",
                         argument=argument)
    return dev


# -- sizes ---------------------------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """`1.5 GB`, `320 MB`, `12 kB` (powers of 1000)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a near-2**63 value: no limit
            return int(text)
    return None


def _address_space_in_use() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_limit() -> tuple[int, str]:
    """The bytes this process may still use and which limit says so: the least of the physical memory, the cgroup
    limit and the room left under `RLIMIT_AS` (`ulimit -v`)."""
    limits = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the physical memory"))
    except (ValueError, OSError):
        pass
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append((cgroup, "the cgroup memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((max(0, soft - _address_space_in_use()), "the room left under RLIMIT_AS (ulimit -v)"))
    return min(limits) if limits else (1 << 62, "no known limit")


def check_memory(nbytes: float, what: str, argument: str) -> None:
    """Refuse (`MemoryLimitError` naming `argument`) a request estimated at `nbytes` that this process cannot hold."""
    limit, source = memory_limit()
    if nbytes > limit:
        raise MemoryLimitError(f"{argument}: {what} needs at least {format_bytes(nbytes)}, more than "
                               f"{source} allows ({format_bytes(limit)})", argument=argument)


# -- documents from disk --------------------------------------------------------------------------------------------

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


def check_model_config(config: Any, *, source: str | os.PathLike = "the model config") -> dict[str, Any]:
    """`ssogvit.models.check_model_config` (the one validator of model configs read from files lives with the models;
    this name stays for the callers of the first version of this module)."""
    from ssogvit.models import check_model_config as check

    return check(config, source=source)
