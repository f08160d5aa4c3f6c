"""`ssogvit <command> ...`: one console script, each command implemented where its work lives.

A user's mistake ends in one or two lines naming the problem and the fix, exit status 2, no traceback; `--debug`
(anywhere on the command line) or the environment variable `SSOGVIT_DEBUG=1` shows the traceback instead. Output
into a pipe that closes early (`ssogvit list | head`) ends quietly with status 141, as a process stopped by SIGPIPE.
SIGINT (Ctrl-C) and SIGTERM (what `kill` and SLURM send) end a command with one line, `ssogvit <command>: stopped by
SIGTERM; <what to do>`, and exit status 128 + the signal's number (130, 143); every file it wrote is whole (each is
written atomically), and a training run resumes from its last epoch-end checkpoint (`resume=auto`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from ssogvit.errors import DEBUG_ENV, Interrupted, debug_enabled, format_error, user_errors
from ssogvit.extras import missing, require_extra

# command -> (module, function, extra it needs beyond the core (ssogvit.extras), one-line help). Modules are imported
# only when their command runs, after its extra is found installed.
COMMANDS: dict[str, tuple[str, str, str | None, str]] = {
    "main": ("ssogvit.train.main_job", "main", "train",
             "train SSoG and its MHA twin on the embedded digits data; print a table"),
    "train": ("ssogvit.train.cli", "train_main", "train",
              "train a model (Hydra overrides, e.g. experiment=cifar100_vit_base_ssog)"),
    "eval": ("ssogvit.train.cli", "eval_main", "train",
             "evaluate a checkpoint, optionally at another image or patch size"),
    "transfer": ("ssogvit.train.cli", "transfer_main", "train",
                 "linear probe or fine-tune a checkpoint on another dataset"),
    "convert": ("ssogvit.convert.cli", "convert_main", "train",
                "turn a trained attention ViT into an SSoG ViT (fit + distil)"),
    "list": ("ssogvit.train.cli", "list_main", "train", "list models, mixers and experiment configs"),
    "report": ("ssogvit.train.report", "main", "train",
               "paper tables (ours beside the paper's) and curves from finished runs"),
    "bench": ("ssogvit.bench.cli", "main", "bench", "efficiency benchmarks: models, operator, flops"),
    "export": ("ssogvit.export", "main", None,
               "write a checkpoint as ONNX, TorchScript or an exported program; check parity"),
    "analyze": ("ssogvit.analysis.cli", "main", "analysis",
                "look inside a model: fields, atoms, lipschitz, sinks, steering, transfer"),
}


def _usage() -> str:
    lines = ["usage: ssogvit [--version] <command> [options] [--debug]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, _, help_) in COMMANDS.items()]
    lines += ["", "Run `ssogvit <command> --help` for a command's options. --debug (or SSOGVIT_DEBUG=1): show the "
              "traceback of an error."]
    return "\n".join(lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from ssogvit import __version__

    try:
        installed = version("ssogvit")
    except PackageNotFoundError:
        installed = __version__
    return f"ssogvit {__version__}" + (f" (installed metadata says {installed})" if installed != __version__ else "")


def _help_without_extra(name: str, rest: list[str]) -> int:
    """``ssogvit <command> --help`` where the command's extra is missing: its own help where the command can give it
    without the extra, else its description and the extra to install (exit status 0 either way: help was asked)."""
    module, func, extra, help_ = COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except ImportError:  # the command's help itself needs the extra (Hydra builds `train --help`)
        pass
    print(f"usage: ssogvit {name} [options]\n\n{help_}\n\nThis command needs the '{extra}' extra "
          f"({', '.join(missing(extra))} not installed): pip install 'ssogvit[{extra}]'; its full --help comes with "
          "it.")
    return 0


def _end_quietly_on_closed_pipe() -> int:
    """The reader of stdout went away: send the rest to /dev/null so that Python's exit flush cannot complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` (a `KeyboardInterrupt`) while a command runs; the old handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ[DEBUG_ENV] = "1"  # read by each command's error reporting (and by its subprocesses)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("--version", "-V"):
        print(_version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ssogvit: unknown command {name!r}; expected one of: {', '.join(COMMANDS)} (see `ssogvit --help`)",
              file=sys.stderr)
        return 2
    module, func, extra, _ = COMMANDS[name]
    try:
        with _signals_interrupt():
            if extra and missing(extra) and any(a in ("-h", "--help") for a in rest):
                return _help_without_extra(name, rest)
            if extra:
                require_extra(extra, "this command")
            result = getattr(importlib.import_module(module), func)(rest)
            sys.stdout.flush()  # a closed pipe shows here, not in Python's exit flush
    except BrokenPipeError:
        return _end_quietly_on_closed_pipe()
    except KeyboardInterrupt as err:
        if debug_enabled():
            raise
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        print(f"ssogvit {name}: {err if isinstance(err, Interrupted) else 'interrupted'}", file=sys.stderr)
        return 128 + int(signum)
    except Exception as err:  # a user error a command did not report itself
        if debug_enabled() or not isinstance(err, user_errors()):
            raise
        print(format_error(f"ssogvit {name}", err), file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
