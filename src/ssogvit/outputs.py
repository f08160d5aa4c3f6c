"""One way out: every file a command writes, and every folder a command owns (docs/DEVELOPING.md, "How a command
takes input and writes output").

Files:

- `check_output_file` / `check_output_folder` check an output before any work: the folder exists (a file's) or can
  be created (a folder's), is a folder and is writable; a file that exists is replaced only when the user asked
  (`--overwrite`, the one spelling of every command); an output may not be one of the command's inputs. What is
  replaced is only ever a regular file: a folder, a link, a device, a FIFO or a socket at an output's path is refused
  with or without `--overwrite` (`check_replaceable`, asked by every check and again just before each rename).
- `atomic_write(path, write)` is the one writer: `write(tmp)` fills a temporary file in the same folder, which is
  flushed to disk, given the mode the umask asks for, then renamed to `path` (and the folder flushed): a kill leaves
  the old file or nothing under `path`. Without `overwrite` the rename never replaces a file that appeared meanwhile.
- `staged_outputs(folder)` gives a command that writes several files a private folder to write them into; on
  success they are moved into `folder` together (all refused if one exists without `overwrite`), on failure
  nothing is.

Temporary files and folders are named `.<name>.ssogvit-tmp-<host>-<pid>-<random>[<suffix>]`; `remove_stale_temp_files`
removes only names of that form whose writer (this host, that pid) is no longer alive, never a user's own file.

The folders a command owns (a run's lock, `run.json`, when a launch may resume) are the training package's
(`ssogvit.train.run_folder`). This module imports the standard library and `ssogvit.errors` only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from ssogvit.errors import InputError

__all__ = [
    "OutputError", "OutputExistsError", "OVERWRITE_FLAG", "TEMP_TAG", "HOST",
    "check_output_file", "check_output_folder", "run_folder_of", "RUN_STATE_FILE", "check_replaceable",
    "atomic_write", "write_text", "write_bytes", "write_json",
    "staged_outputs", "temp_path", "is_temp_name", "remove_stale_temp_files", "replace_folder",
]

OVERWRITE_FLAG = "--overwrite"  # the one spelling, for every command
TEMP_TAG = "ssogvit-tmp"


class OutputError(InputError):
    """An output a command may not write: a missing or read-only folder, a file where a folder belongs, an input."""


class OutputExistsError(OutputError, FileExistsError):
    """An output that exists, and the user did not ask to replace it."""


# -- checks before any work -----------------------------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def check_replaceable(path: str | os.PathLike, argument: str | None = None) -> None:
    """Nothing, if nothing is at `path` or a regular file is (what a writer may replace); `OutputError` naming the
    kind of node otherwise, whatever `overwrite` says: ssogvit replaces only regular files, never a folder, a link, a
    device, a FIFO or a socket (a copy of `/dev/full` replaced by a file would be a device lost)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the folder's own checks name a bad folder)
        return
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    where = f"{argument}: " if argument and argument != str(path) else ""
    raise OutputError(f"{where}{path} is {kind}, not a regular file; ssogvit replaces only regular files (with or "
                      f"without {OVERWRITE_FLAG}): choose another path", argument=argument or str(path))


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


#: the file that marks a folder as one run's (`ssogvit.train.run_folder` writes it): a run folder holds that run's
#: files only, so no other command's output folder is, or lies inside, one (`check_output_folder`)
RUN_STATE_FILE = "run.json"


def run_folder_of(path: str | os.PathLike) -> Path | None:
    """The run folder `path` is or lies inside (the nearest one holding `RUN_STATE_FILE`), or None."""
    p = Path(path).expanduser().resolve()  # `..` and links resolved: where the files would land, not how it is spelled
    return next((q for q in (p, *p.parents) if (q / RUN_STATE_FILE).is_file()), None)


def check_output_folder(folder: str | os.PathLike, argument: str = "--out", *, run: bool = False) -> Path:
    """`folder` as a `Path` if a command may write into it: an existing writable folder, or one that can be
    created (its nearest existing ancestor is a writable folder), that is not a run folder nor inside one (`run`:
    the command is the run that owns `folder`, which may hold its own `RUN_STATE_FILE` but lie in no other run's
    folder); `OutputError` naming `argument` otherwise."""
    if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
        raise OutputError(f"{argument}={folder!r}: expected the path of a folder", argument=argument)
    p = Path(folder).expanduser()
    _refuse_run_folder(p, p.parent if run else p, argument, "folder")
    if p.exists():
        if not p.is_dir():
            raise OutputError(f"{argument}: {p} is a file, not a folder", argument=argument)
        if not _writable(p):
            raise OutputError(f"{argument}: the folder {p} is not writable (permission denied)", argument=argument)
        return p
    ancestor = _nearest_existing(p.parent)
    if not ancestor.is_dir():
        raise OutputError(f"{argument}: {p} cannot be created: {ancestor} is a file, not a folder", argument=argument)
    if not _writable(ancestor):
        raise OutputError(f"{argument}: {p} cannot be created: {ancestor} is not writable (permission denied)",
                          argument=argument)
    return p


def _refuse_run_folder(p: Path, where: Path, argument: str, kind: str) -> None:
    """The one rule of both checks: no command writes into a run's folder but the run (`where` is, or lies in, one)."""
    owner = run_folder_of(where)
    if owner is not None:
        inside = "is" if owner == p.expanduser().resolve() else f"lies inside {owner}, which is"
        raise OutputError(f"{argument}: {p} {inside} the folder of a run (it holds {RUN_STATE_FILE}); a run folder "
                          f"holds its run's files only: choose a {kind} outside it", argument=argument)


def check_output_file(path: str | os.PathLike, argument: str = "--out", *, overwrite: bool = False,
                      inputs: Iterable[str | os.PathLike] = (), hint: str = OVERWRITE_FLAG) -> Path:
    """`path` as a `Path` if a command may write it: not a folder, in an existing writable folder that is not a run's
    folder nor inside one (a run's files are its own: `check_output_folder`'s rule), not one of `inputs`, and not
    existing unless `overwrite`; `OutputError` naming `argument` otherwise.

    Args:
        hint: how the caller asks to replace a file (`--overwrite` on the command line, `overwrite=True` in Python).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise OutputError(f"{argument}={path!r}: expected the path of a file", argument=argument)
    p = Path(path).expanduser()
    if p.is_dir():
        raise OutputError(f"{argument}: {p} is a folder; give the name of a file", argument=argument)
    check_replaceable(p, argument)
    parent = p.parent
    if not parent.exists():
        raise OutputError(f"{argument}: the folder {parent} does not exist", argument=argument)
    if not parent.is_dir():
        raise OutputError(f"{argument}: {parent} is a file, not a folder", argument=argument)
    if not _writable(parent):
        raise OutputError(f"{argument}: the folder {parent} is not writable (permission denied)", argument=argument)
    _refuse_run_folder(p, parent, argument, "file")
    for source in inputs:
        if p.exists() and Path(source).exists() and os.path.samefile(p, source):
            raise OutputError(f"{argument}: {p} is one of this command's inputs; write the output elsewhere",
                              argument=argument)
    if p.exists() and not overwrite:
        raise OutputExistsError(f"{argument}: {p} exists; pass {hint} to replace it, or choose another file",
                                argument=argument)
    return p


# -- temporary names ------------------------------------------------------------------------------------------------

#: this machine's name as temporary names (and run folders' locks) give it
HOST = re.sub(r"[^A-Za-z0-9.]", "", socket.gethostname()) or "host"
_TEMP = re.compile(rf"^\..*\.{TEMP_TAG}-(?P<host>[A-Za-z0-9.]+)-(?P<pid>\d+)-[0-9a-f]{{8}}")


def temp_path(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside `path`, recognisably ours, with `path`'s suffix (some writers go by it)."""
    p = Path(path)
    return p.with_name(f".{p.name}.{TEMP_TAG}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}{p.suffix}")


def is_temp_name(name: str) -> bool:
    """Whether `name` is a temporary name `temp_path` gives."""
    return _TEMP.match(name) is not None


def _writer_alive(name: str) -> bool:
    m = _TEMP.match(name)
    if m is None or m["host"] != HOST:
        return True  # another machine's (a shared file system): it cannot be told dead from here
    try:
        os.kill(int(m["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temp_files(folder: str | os.PathLike, *, subfolders: Sequence[str] = (".",)) -> list[Path]:
    """Remove from `folder` (and its `subfolders`) the temporary files and folders ours writers left when killed
    (names of `temp_path`'s form whose process on this host is gone); nothing else is touched."""
    removed = []
    for sub in subfolders:
        d = Path(folder) / sub
        for path in d.iterdir() if d.is_dir() else ():
            if is_temp_name(path.name) and not _writer_alive(path.name):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
    return removed


# -- the one writer -------------------------------------------------------------------------------------------------


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path, *, overwrite: bool) -> None:
    """Rename `tmp` to `path` atomically; without `overwrite`, never over a file that exists; never over anything but
    a regular file (`check_replaceable`, asked again here: the node may have appeared since the command's checks)."""
    check_replaceable(path)
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if `path` exists, even one created a moment ago by another process
    except FileExistsError:
        raise OutputExistsError(f"{path} exists; pass {OVERWRITE_FLAG} to replace it", argument=str(path)) from None
    except OSError:  # a file system without hard links
        if path.exists():
            raise OutputExistsError(f"{path} exists; pass {OVERWRITE_FLAG} to replace it",
                                    argument=str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], *, overwrite: bool = False) -> Path:
    """`write(tmp)` to a temporary file beside `path`, flushed to disk, then renamed to `path`; returns `path`.

    The rename is atomic on a POSIX file system, so `path` holds the old or the new content, never a mix, whatever
    kills the process; the temporary file is removed on failure (a SIGKILL leaves it, named by `temp_path`, for
    `remove_stale_temp_files`). The file gets the mode an ordinary `open` gives (`0o666` less the umask) and the
    folder is flushed after the rename, so the new name survives a power cut. The folder is created if missing.

    Args:
        overwrite: replace an existing `path` (otherwise `OutputExistsError`, and nothing is written).
    """
    path = Path(path)
    check_replaceable(path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} exists; pass {OVERWRITE_FLAG} to replace it", argument=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob_escape(path.name)}.{TEMP_TAG}-*"):  # a killed earlier write of this file
        if is_temp_name(stale.name) and not _writer_alive(stale.name) and stale.is_file():
            stale.unlink(missing_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        if not tmp.is_file():
            raise OutputError(f"nothing was written to {path}", argument=str(path))
        os.chmod(tmp, 0o666 & ~_umask())  # after the write: a writer may replace the file (safetensors does)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _publish(tmp, path, overwrite=overwrite)
        _fsync_folder(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """`text` (UTF-8) to `path` through `atomic_write`."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), overwrite=overwrite)


def write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """`data` to `path` through `atomic_write`."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), overwrite=overwrite)


def write_json(path: str | os.PathLike, data: Any, *, overwrite: bool = False,
               default: Callable[[Any], Any] | None = None) -> Path:
    """`data` as indented JSON to `path` through `atomic_write`.

    Args:
        default: what a value JSON does not know becomes (`json.dumps`'s `default`: `str`, or
            `ssogvit.results.jsonable` for tensors and paths); None refuses it with `TypeError`.
    """
    return write_text(path, json.dumps(data, indent=2, default=default) + "\n", overwrite=overwrite)


@contextlib.contextmanager
def staged_outputs(folder: str | os.PathLike, argument: str = "--out", *, overwrite: bool = False) -> Iterator[Path]:
    """`with staged_outputs(out) as stage:` write files under `stage`; on success they move to the same place
    under `out` (each rename atomic); if one exists there and `overwrite` is not set, none moves and
    `OutputExistsError` names them. On failure nothing moves; a folder created for the outputs is removed again."""
    out = check_output_folder(folder, argument)
    created = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out)
    stage = temp_path(out / "outputs")
    stage.mkdir()
    published = False
    try:
        yield stage
        files = sorted(p for p in stage.rglob("*") if p.is_file())
        targets = [out / p.relative_to(stage) for p in files]
        for t in targets:
            check_replaceable(t, argument)
        existing = [str(t) for t in targets if t.exists()]
        if existing and not overwrite:
            shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
            raise OutputExistsError(f"{argument}: {shown} already exist(s); pass {OVERWRITE_FLAG} to replace, or "
                                    "choose another folder", argument=argument)
        for src, dst in zip(files, targets):
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(src, 0o666 & ~_umask())
            with open(src, "rb+") as f:
                os.fsync(f.fileno())
            _publish(src, dst, overwrite=overwrite)
            _fsync_folder(dst.parent)
        published = True
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not published:
            for p in created:  # innermost first
                with contextlib.suppress(OSError):
                    p.rmdir()


def replace_folder(folder: str | os.PathLike, write: Callable[[Path], None], *, owned: Sequence[str]) -> Path:
    """Write a folder whole, replacing one of the same kind, as timm's and Hugging Face's ``save_pretrained`` do.

    ``write(stage)`` fills a fresh temporary folder beside ``folder``; its files are synced, then it takes
    ``folder``'s place by rename (an existing ``folder`` is first renamed aside, then removed), so at every moment
    ``folder`` is the old complete folder, the new complete one, or, between the two renames, absent: never half
    written. What may be replaced is a folder that holds nothing but the names ``owned`` (what the writer writes);
    a file, a link, or a folder with anything else in it is refused with ``FileExistsError`` naming what is there, and
    nothing is written. On failure the stage is removed and ``folder`` is left as it was.
    """
    target = Path(folder)
    _refuse_run_folder(target, target, "folder", "folder")  # a saved model is no run's file
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"{target} exists and is not a folder; save into a folder (nothing was written)")
    if target.is_dir():
        others = sorted(p.name for p in target.iterdir() if p.name not in owned)
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise FileExistsError(f"{target} holds {shown}, which a saved model does not: it is not a saved model's "
                                  "folder, so it is not replaced (nothing was written); choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    stage, aside = temp_path(target), temp_path(target)
    stage.mkdir()
    try:
        write(stage)
        for p in stage.rglob("*"):
            if p.is_file():
                os.chmod(p, 0o666 & ~_umask())
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
        os.chmod(stage, 0o777 & ~_umask())
        if target.is_dir():
            os.rename(target, aside)
        os.rename(stage, target)
        _fsync_folder(target.parent)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
    return target
