"""`ssogvit ...` in a child process that does not pay for the imports: the console script's entry function
(`ssogvit.cli.main`) runs in a process forked from a server that imported ssogvit, its commands, torch, Lightning and
Hydra once (the standard library's multiprocessing forkserver). Interpreter start-up and those imports are about
5 s of a 2-core machine per command, most of the cost of a command-line test.

What the child gets is what `python -m ssogvit ARGS` gets: its own process, `sys.argv`, environment and working
folder, stdin from /dev/null, stdout and stderr in files (returned as text, `\\r` kept), the exit status of
`sys.exit(main())`, and an uncaught exception's traceback with status 1. What it does not get is a fresh
interpreter: the tests about the process itself (signals, a closed pipe, a missing extra, the bad-input sample)
start the real console script with `subprocess`.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ssogvit.cli import COMMANDS

#: imported once by the server: what every command needs before it starts its own work (each command's module, read
#: from the console script's own table)
PRELOAD = ["torch", "timm", "lightning.pytorch", "hydra", "ssogvit.cli",
           *dict.fromkeys(module for module, *_ in COMMANDS.values())]

_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(argv: list[str], cwd: str | None, env: dict[str, str], out: str, err: str) -> None:
    import traceback

    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    import torch

    import ssogvit.cli

    if env.get("OMP_NUM_THREADS", "").isdigit():  # read by torch at import in a fresh interpreter
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [str(Path(ssogvit.cli.__file__).with_name("__main__.py")), *argv]
    try:
        code = ssogvit.cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`ssogvit *argv` in a forked child: a `CompletedProcess` with text stdout and stderr (`\\r` kept);
    `subprocess.TimeoutExpired` after `timeout` seconds (the child is killed)."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch(), err.touch()
        child = _server().Process(target=_child, args=(list(argv), None if cwd is None else str(cwd), env,
                                                       str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["ssogvit", *argv], timeout)
        return subprocess.CompletedProcess(["ssogvit", *argv], child.exitcode,  # -N: killed by signal N
                                           out.read_bytes().decode(errors="replace"),
                                           err.read_bytes().decode(errors="replace"))
