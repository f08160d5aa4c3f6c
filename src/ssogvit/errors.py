"""A user's mistake and how a command reports it (docs/DEVELOPING.md, "How a command takes input and writes output").

`UserError` is the one base class of a user's mistake: every error ssogvit raises for what it was given (`InputError`
of the argument checks, `UsageError` of a command, `ssogvit.train.TrainError`, `ssogvit.data.DataError`, ...) derives
from it, so the command line's reporter catches one class and this module imports nothing above it. A user error
ends a command in one or two lines naming the problem and the fix, exit status 2, no traceback (unless `--debug` or
`SSOGVIT_DEBUG=1`). `Interrupted` is how SIGINT and SIGTERM end a command: one line, exit status 128 + the signal's
number.

This module imports only the standard library: it is the bottom of the bottom floor.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

__all__ = ["DEBUG_ENV", "ArgumentParser", "InputError", "InputTypeError", "Interrupted", "UsageError", "UserError",
           "debug_enabled", "format_error", "refused", "report_errors", "user_errors"]

DEBUG_ENV = "SSOGVIT_DEBUG"


class UserError(Exception):
    """A user's mistake, not a bug: a value, a file, an option or a launch ssogvit refuses; the message says what was
    wrong and what to do instead. Reported by a command in one or two lines, exit status 2."""


class InputError(UserError, ValueError):
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


def refused(name: str, value: Any, expected: str, *, wrong_type: bool = False) -> InputError:
    """The error refusing `value` of the argument `name`: `name=<value>: expected <expected>` (the value shortened to
    60 characters); an `InputTypeError` if the value is of the wrong type."""
    cls = InputTypeError if wrong_type else InputError
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return cls(f"{name}={shown}: expected {expected}", argument=name, expected=expected)


class UsageError(UserError):
    """Bad input to a command (a file it cannot use, an option it does not take); the message names the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error reported in one line (exit status 2) instead of the usage block, and an option
    that holds one value given twice refused (argparse keeps the last: `eval --ckpt a --ckpt b` evaluated `b` alone
    without a word)."""

    _SINGLE = (argparse._StoreAction, argparse._StoreConstAction)  # store_true and store_false are store_const

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        single = {o: a for a in self._actions if isinstance(a, self._SINGLE) for o in a.option_strings}
        seen: dict[argparse.Action, str] = {}
        for i, token in enumerate(argv):
            if token == "--":
                break
            action = single.get(token.split("=", 1)[0]) if token.startswith("-") else None
            if action is None:
                continue
            value = "=" not in token and action.nargs is None and not isinstance(action, argparse._StoreConstAction)
            shown = f"{token} {argv[i + 1]}" if value and i + 1 < len(argv) else token
            if action in seen:
                self.error(f"{token.split('=', 1)[0]} is given twice ({seen[action]}, then {shown}); give it once")
            seen[action] = shown
        return super().parse_known_args(args, namespace)


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (what SLURM and `kill` send) stopped a command.

    Attributes:
        signum: the signal's number.
        detail: what the command left behind and how to go on (`last.ckpt resumes the run ...`), or empty.
    """

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(signum, detail)
        self.signum = signum
        self.detail = detail

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"stopped by {name}" + (f"; {self.detail}" if self.detail else "")


def debug_enabled() -> bool:
    """Whether errors show their traceback (`--debug`, or `SSOGVIT_DEBUG` set to anything but 0/empty)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's input, not a bug: reported in one or two lines, exit status 2.

    Ours are the `UserError`s; Hydra's and OmegaConf's count where their modules were imported: one that was never
    imported cannot have been raised, and a command without the training extra runs without them.
    """
    found: list[type[BaseException]] = [UserError]
    for module, name in (("hydra.errors", "HydraException"), ("omegaconf.errors", "OmegaConfBaseException")):
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


def format_error(prog: str, err: BaseException) -> str:
    """`prog: <message>`: the first two lines of the error's message on one line.

    An error raised in a data-loading worker arrives as `Caught <Error> in DataLoader worker...` followed by the
    worker's traceback; its own message is the traceback's last line. A config Hydra cannot find is named with the
    closest of the options it had.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    if lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        lines = [lines[-1].split(": ", 1)[-1]]
    hydra_errors = sys.modules.get("hydra.errors")  # Hydra's error only where Hydra ran
    if hydra_errors is not None and isinstance(err, hydra_errors.MissingConfigException) and err.options:
        import difflib

        asked = str(err.missing_cfg_file or "").rsplit("/", 1)[-1]
        close = difflib.get_close_matches(asked, err.options, n=3, cutoff=0.5)
        more = ", ..." if len(err.options) > 8 else ""
        hint = f"did you mean {' or '.join(close)}?" if close else f"options: {', '.join(err.options[:8])}{more}"
        lines = [lines[0].split(" Available options")[0] + ";", f"{hint} (`ssogvit list` shows all)"]
    return f"{prog}: " + " ".join(lines[:2])


def report_errors(prog: str, run) -> int:
    """`run()`'s exit status, or 2 with `prog: <message>` (at most two lines, no traceback) on a user error.

    With `--debug` or `SSOGVIT_DEBUG=1` the error is raised with its traceback instead.
    """
    try:
        return int(run() or 0)
    except user_errors() as err:
        if debug_enabled():
            raise
        print(format_error(prog, err), file=sys.stderr)
        return 2
