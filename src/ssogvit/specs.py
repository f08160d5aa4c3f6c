"""Argument specs: how every public constructor and every command checks what it is given, before any work.

An argument is declared once, as a `Spec` (`Int`, `Float`, `Choice`, `Flag`, `Text`, `IntOrPair`, `Ints`), and the
one declaration serves the three places a value comes from (docs/DEVELOPING.md, "How a command takes input and
writes output"):

- a constructor or function: its parameter is annotated `Annotated[int, IMG_SIZE]` and the function is wrapped with
  `@checked`, which checks every argument the caller passed;
- a command-line option: `parser.add_argument("--img-size", type=IMG_SIZE.argparse)`;
- a key of the Hydra run config: `ssogvit.train.config.RUN_CONFIG_RULES` maps `data.img_size` to `IMG_SIZE`.

A refused value raises `InputError` (a `ValueError`; `InputTypeError`, also a `TypeError`, for a value of the wrong
type; both in `ssogvit.errors`) whose one-line message names the argument, the value and what was expected; the
command line reports it as `ssogvit <command>: <message>` with exit status 2.

Types are strict: an integer argument takes an `int`, a numpy integer or a 0-d integer tensor (exact integers,
what `operator.index` accepts, as Python's `range` and PyTorch's size arguments do) and refuses `224.5`, `224.0`
(a whole float usually comes from arithmetic such as `img_size / 2`; truncating it would hide that), `"224"` and
`True`. A float argument takes any real number but a bool, and refuses NaN and infinities unless declared.

The arguments several surfaces share (`IMG_SIZE`, `PATCH_SIZE`, `EMBED_DIM`, ...) are declared here; the others
where they belong (`NUM_ATOMS` in `ssogvit.layers.ssog`). This module imports the standard library, numpy, torch and
`ssogvit.errors` only: the layers and models use it.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import numbers
import operator
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ssogvit.errors import InputError, refused

__all__ = [
    "Spec", "Int", "Float", "Choice", "Flag", "Text", "IntOrPair", "Items", "Ints", "checked", "check_args",
    "AppliesOnly", "check_applies", "check_images",
    "IMG_SIZE", "PATCH_SIZE", "BATCH_SIZE", "NUM_CLASSES", "IN_CHANS", "NUM_WORKERS", "SEED",
    "EMBED_DIM", "NUM_HEADS", "DEPTH", "MLP_RATIO", "NUM_REGISTERS", "DROP_RATE", "GRID_RATIO", "add_img_size_option",
]


# -- specs: one declaration per argument ---------------------------------------------------------------------------


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
            raise refused(name, value, self._expected(), wrong_type=True)
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
            raise refused(name, value, self._expected(), wrong_type=True)
        if v not in self.also and not _in_range(v, self.low, self.high, False, False):
            raise refused(name, value, self._expected())
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
            raise refused(name, value, self._expected(), wrong_type=True)
        v = float(value)
        if (self.finite and not math.isfinite(v)) or math.isnan(v):
            raise refused(name, value, self._expected())
        if not _in_range(v, self.low, self.high, self.low_open, self.high_open):
            raise refused(name, value, self._expected())
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
            raise refused(name, value, self._expected(), wrong_type=not isinstance(value, str))
        return value


@dataclass(frozen=True)
class Flag(Spec):
    """A bool (`true`/`false` on a command line); `0` and `1` are not bools."""

    def expected(self) -> str:
        return "true or false"

    def _check(self, value: Any, name: str) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise refused(name, value, self._expected(), wrong_type=True)
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
            raise refused(name, value, self._expected(), wrong_type=True)
        if not self.empty and not value.strip():
            raise refused(name, value, self._expected())
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
                raise refused(name, value, self._expected(), wrong_type=True)
            try:
                return tuple(self.item.check(v, name) for v in value)
            except InputError as err:
                raise refused(name, value, self._expected(), wrong_type=isinstance(err, TypeError)) from None
        try:
            return self.item.check(value, name)
        except InputError as err:
            raise refused(name, value, self._expected(), wrong_type=isinstance(err, TypeError)) from None


@dataclass(frozen=True)
class Items(Spec):
    """A list of `min_len` to `max_len` values of `item` (`16,14,8` on a command line), each once if `distinct`;
    returned as a list."""

    item: Spec = Int()
    min_len: int = 1
    max_len: int | None = None
    distinct: bool = False  # no value twice (seeds: two runs of one seed would be one run twice)

    def expected(self) -> str:
        count = (f"{self.min_len} or more" if self.max_len is None else str(self.min_len)
                 if self.max_len == self.min_len else f"{self.min_len} to {self.max_len}")
        each = self.item.expected().replace("an integer", "integers", 1).replace("a number", "numbers", 1)
        return f"a list of {count} {'distinct ' if self.distinct else ''}{each}"

    def _check(self, value: Any, name: str) -> list[Any]:
        listlike = isinstance(value, Sequence) and not isinstance(value, (str, bytes))  # OmegaConf's ListConfig too
        if not listlike or not self.min_len <= len(value) <= (self.max_len or len(value)):
            raise refused(name, value, self._expected(), wrong_type=not listlike)
        try:
            out = [self.item.check(v, name) for v in value]
        except InputError as err:
            raise refused(name, value, self._expected(), wrong_type=isinstance(err, TypeError)) from None
        if self.distinct and len(set(out)) < len(out):
            raise refused(name, value, self._expected())
        return out

    def _parse(self, text: str, name: str) -> Any:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return [self.item._parse(p, name) for p in parts]


#: the name of `Items` where the items are integers (the default item), as the API has always spelled it
Ints = Items


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


@dataclass(frozen=True)
class AppliesOnly:
    """An option that only some settings of the other options use (the steering radius: a steered mixer; an ODE
    solver's tolerances: an adaptive solver). Given at another value than its default where `when` of all the
    arguments is false, it would be recorded and ignored: `check_applies` refuses it, naming it and what it needs."""

    when: Callable[[Mapping[str, Any]], bool]
    needs: str  # what makes it apply, as the refusal says it: "a steered mixer (steer=...)"


def check_applies(rules: Mapping[str, AppliesOnly], given: Mapping[str, Any], defaults: Mapping[str, Any],
                  arguments: Any) -> None:
    """`InputError` for the first option of `rules` that the caller `given` at another value than its default while
    its rule does not apply to `arguments` (what the rules' `when` reads: every argument of a call, defaults
    included, or a run config's `v(dotted key)`). An option left at its default passes: a saved config records every
    option, and rebuilding from it must not fail."""
    for name, rule in rules.items():
        if name in given and _differs(given[name], defaults.get(name)) and not rule.when(arguments):
            shown = repr(given[name]) if len(repr(given[name])) <= 60 else repr(given[name])[:57] + "..."
            raise InputError(f"{name}={shown} applies only to {rule.needs}; here it would be recorded and ignored: "
                             f"leave it out", argument=name, expected=f"{name} only with {rule.needs}")


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except (TypeError, ValueError, RuntimeError):  # a tensor or array compared element-wise: not the default
        return True


def checked(func: Callable | None = None, *, applies: Mapping[str, AppliesOnly] | None = None) -> Callable:
    """Check, at every call, each argument the caller passed whose parameter is annotated `Annotated[T, spec]`, and
    (`applies`) that no option is given where the other arguments make it unused (`check_applies`). Used as
    `@checked` or `@checked(applies={...})`, the rules declared beside the signature.

    The wrapped function receives the normalised values (`np.int64(4)` arrives as `4`); a refused one raises
    `InputError` / `InputTypeError` naming the parameter. Defaults are not checked (they are the author's).
    """
    if func is None:
        return functools.partial(checked, applies=applies)
    signature = inspect.signature(func)
    specs: dict[str, Spec] | None = None
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal specs
        if specs is None:  # on first use: the annotations may name what is defined after the function
            specs = _specs_of(func)
        bound = signature.bind(*args, **kwargs)
        for param, spec in specs.items():
            if param in bound.arguments:
                bound.arguments[param] = spec.check(bound.arguments[param], param)
        if applies:
            check_applies(applies, bound.arguments, defaults, {**defaults, **bound.arguments})
        return func(*bound.args, **bound.kwargs)

    return wrapper


def check_images(images: Any) -> None:
    """Refuse what no model takes as images (`InputError` naming `images`): not a `(B, C, H, W)` tensor, or a batch of
    0 (every exported file refuses it too: docs/models.md, "Deployment"). Checked by ssogvit's models and by a timm
    ViT that `ssogify` made an SSoG ViT."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise InputError(f"expected images of shape (B, C, H, W), got {shape}", argument="images")
    if images.shape[0] == 0:
        raise InputError(f"an empty batch {tuple(images.shape)}: a model takes 1 image or more", argument="images")


def check_args(specs: Mapping[str, Spec], values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` checked against `specs` (keys without a spec pass unchanged): the run config's way to use a table."""
    return {k: specs[k].check(v, k) if k in specs else v for k, v in values.items()}


# -- the arguments several surfaces share (a constructor, a command-line option and a run-config key) -------------

#: image side in pixels (`create_model(img_size=)`, `ssogvit eval --img-size`, `data.img_size`)
#: a grid's ratio to another (`rescale_field`): new grid over old, positive and finite
GRID_RATIO = Float(0, low_open=True)
IMG_SIZE = Int(1, 16384)


class _ImageSize(argparse.Action):
    """``--img-size N`` or ``--img-size H W`` as ``(H, W)``. argparse hands an option of one or more values every word
    up to the next option, so a command's overrides after it (``data.root=...``) arrive here too: they are handed back
    in ``img_size_rest`` (the words after the size's one or two)."""

    def __call__(self, parser, namespace, values, option_string=None):
        words = list(values)
        size = [words.pop(0)] + ([words.pop(0)] if words and "=" not in words[0] else [])
        try:
            sides = [IMG_SIZE.parse(w, option_string) for w in size]
        except InputError:
            parser.error(f"argument {option_string}: expected N or H W, each {IMG_SIZE.expected()}, got "
                         f"{' '.join(size)!r}")
        setattr(namespace, self.dest, (sides[0], sides[-1]))
        namespace.img_size_rest = getattr(namespace, "img_size_rest", []) + words


def add_img_size_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--img-size N`` (a square) or ``--img-size H W``: the one spelling of every command that takes an image size
    (``eval``, ``export``). The parsed value is ``(H, W)``; words argparse gave it that are not part of it are in
    ``img_size_rest`` (a command's overrides)."""
    parser.add_argument("--img-size", nargs="+", action=_ImageSize, metavar="N", default=None,
                        help=f"{help}: N for N x N, or H W")
    parser.set_defaults(img_size_rest=[])


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
