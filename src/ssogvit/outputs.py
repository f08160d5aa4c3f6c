"""One way out: every file a command writes, and every folder a command owns (docs/DEVELOPING.md, "How a command
takes input and writes output").

Files:

- `check_output_file` / `check_output_folder` check an output before any work: the folder exists (a file's) or can
  be created (a folder's), is a folder and is writable; a file that exists is replaced only when the user asked
  (`--overwrite`, the one spelling of every command); an output may not be one of the command's inputs.
- `atomic_write(path, write)` is the one writer: `write(tmp)` fills a temporary file in the same folder, which is
  flushed to disk, given the mode the umask asks for, then renamed to `path` (and the folder flushed): a kill leaves
  the old file or nothing under `path`. Without `overwrite` the rename never replaces a file that appeared meanwhile.
- `staged_outputs(folder)` gives a command that writes several files a private folder to write them into; on
  success they are moved into `folder` together (all refused if one exists without `overwrite`), on failure
  nothing is.

Temporary files and folders are named `.<name>.ssogvit-tmp-<host>-<pid>-<random>[<suffix>]`; `remove_stale_temp_files`
removes only names of that form whose writer (this host, that pid) is no longer alive, never a user's own file.

Folders: `RunFolder` is what a folder that belongs to one run of one command holds and when a launch may use it:
`.ssogvit.lock` (an exclusive `flock` held by the live run; the OS releases it when the process dies), `run.json`
(`{"status": "running" | "finished", "command": ...}`), `config.yaml` (the run's config). A launch may use a folder
that holds no run, or resume the unfinished run of the same command and config; anything else is a `FolderError`
whose one line says how to resume or where to write instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from ssogvit.inputs import DocumentError, InputError, read_document

__all__ = [
    "OutputError", "OutputExistsError", "FolderError", "OVERWRITE_FLAG", "TEMP_TAG", "LOCK_NAME", "STATE_NAME",
    "RUN_FILES", "IGNORED_KEYS",
    "check_output_file", "check_output_folder", "atomic_write", "write_text", "write_bytes", "write_json",
    "staged_outputs", "temp_path", "is_temp_name", "remove_stale_temp_files", "FolderLock", "RunFolder",
    "config_diff",
]

OVERWRITE_FLAG = "--overwrite"  # the one spelling, for every command
TEMP_TAG = "ssogvit-tmp"
LOCK_NAME, STATE_NAME = ".ssogvit.lock", "run.json"
#: what makes a folder hold a run (anything else in it is left alone)
RUN_FILES = ("config.yaml", "run.json", "checkpoints", "export", "logs", "tb", "fit")
#: run-config keys that may differ between the launches of one run: where things are, not what is computed
IGNORED_KEYS = ("resume", "output_dir", "data.root", "data.num_workers", "data.pin_memory",
                "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.logger", "logger", "progress",
                "cluster")


class OutputError(InputError):
    """An output a command may not write: a missing or read-only folder, a file where a folder belongs, an input."""


class OutputExistsError(OutputError, FileExistsError):
    """An output that exists, and the user did not ask to replace it."""


class FolderError(OutputError):
    """A folder that holds a finished or different run, or that another live process is writing to."""


# -- checks before any work -----------------------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def check_output_folder(folder: str | os.PathLike, argument: str = "--out") -> Path:
    """`folder` as a `Path` if a command may write into it: an existing writable folder, or one that can be
    created (its nearest existing ancestor is a writable folder); `OutputError` naming `argument` otherwise."""
    if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
        raise OutputError(f"{argument}={folder!r}: expected the path of a folder", argument=argument)
    p = Path(folder).expanduser()
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


def check_output_file(path: str | os.PathLike, argument: str = "--out", *, overwrite: bool = False,
                      inputs: Iterable[str | os.PathLike] = (), hint: str = OVERWRITE_FLAG) -> Path:
    """`path` as a `Path` if a command may write it: not a folder, in an existing writable folder, not one of
    `inputs`, and not existing unless `overwrite`; `OutputError` naming `argument` otherwise.

    Args:
        hint: how the caller asks to replace a file (`--overwrite` on the command line, `overwrite=True` in Python).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise OutputError(f"{argument}={path!r}: expected the path of a file", argument=argument)
    p = Path(path).expanduser()
    if p.is_dir():
        raise OutputError(f"{argument}: {p} is a folder; give the name of a file", argument=argument)
    parent = p.parent
    if not parent.exists():
        raise OutputError(f"{argument}: the folder {parent} does not exist", argument=argument)
    if not parent.is_dir():
        raise OutputError(f"{argument}: {parent} is a file, not a folder", argument=argument)
    if not _writable(parent):
        raise OutputError(f"{argument}: the folder {parent} is not writable (permission denied)", argument=argument)
    for source in inputs:
        if p.exists() and Path(source).exists() and os.path.samefile(p, source):
            raise OutputError(f"{argument}: {p} is one of this command's inputs; write the output elsewhere",
                              argument=argument)
    if p.exists() and not overwrite:
        raise OutputExistsError(f"{argument}: {p} exists; pass {hint} to replace it, or choose another file",
                                argument=argument)
    return p


# -- temporary names ------------------------------------------------------------------------------------------------

_HOST = re.sub(r"[^A-Za-z0-9.]", "", socket.gethostname()) or "host"
_TEMP = re.compile(rf"^\..*\.{TEMP_TAG}-(?P<host>[A-Za-z0-9.]+)-(?P<pid>\d+)-[0-9a-f]{{8}}")


def temp_path(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside `path`, recognisably ours, with `path`'s suffix (some writers go by it)."""
    p = Path(path)
    return p.with_name(f".{p.name}.{TEMP_TAG}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}{p.suffix}")


def is_temp_name(name: str) -> bool:
    """Whether `name` is a temporary name `temp_path` gives."""
    return _TEMP.match(name) is not None


def _writer_alive(name: str) -> bool:
    m = _TEMP.match(name)
    if m is None or m["host"] != _HOST:
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
    """Rename `tmp` to `path` atomically; without `overwrite`, never over a file that exists."""
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
               default: Callable[[Any], Any] | None = str) -> Path:
    """`data` as indented JSON to `path` through `atomic_write`."""
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


# -- folders a command owns -----------------------------------------------------------------------------------------


class FolderLock:
    """`with FolderLock(folder):` holds an exclusive `flock` on `folder/.ssogvit.lock` (creating both if needed).

    Raises `FolderError` at once if another live process holds it, or if the lock file there was not written by
    ssogvit (it is never overwritten).
    """

    def __init__(self, folder: str | os.PathLike, *, elsewhere: str = "write elsewhere") -> None:
        self.folder = Path(folder)
        self.elsewhere = elsewhere
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    def __enter__(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FolderError(f"another live run ({holder}) is writing to {self.folder}; wait for it to end "
                              f"or {self.elsewhere}", argument=str(self.folder)) from None
        held = os.read(fd, 200).decode(errors="replace")
        if held.strip() and not held.startswith("ssogvit "):
            os.close(fd)
            raise FolderError(f"{self.path} exists and was not written by ssogvit; it was left as it is: "
                              f"{self.elsewhere}", argument=str(self.folder))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"ssogvit pid {os.getpid()} on {_HOST}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(node) if isinstance(node, tuple) else node}


def config_diff(saved: Mapping[str, Any], new: Mapping[str, Any], ignored: Sequence[str] = IGNORED_KEYS) -> list[str]:
    """`"key: saved A, now B"` for each key (dotted) that differs, `ignored` keys and their children left out."""
    a, b = _flatten(saved), _flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in ignored or key.startswith(tuple(k + "." for k in ignored)):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: saved {a.get(key, '<absent>')!r}, now {b.get(key, '<absent>')!r}")
    return out


_NO_RESUME = (None, False, "null", "none", "false")


class RunFolder:
    """A folder that belongs to one run of one command: what it holds, who writes to it, whether a launch may use it.

    Args:
        path: the folder.
        command: the command whose runs it holds (`train`, `transfer`, `convert`, ...), recorded in `run.json`.
        elsewhere: how the user writes somewhere else (`output_dir=<new folder>`, `--out <new folder>`).
        ignored: config keys that may differ between the launches of one run.
    """

    def __init__(self, path: str | os.PathLike, *, command: str, elsewhere: str = "output_dir=<new folder>",
                 ignored: Sequence[str] = IGNORED_KEYS) -> None:
        self.path = Path(path)
        self.command = command
        self.elsewhere = elsewhere
        self.ignored = tuple(ignored)

    def lock(self) -> FolderLock:
        """The folder's lock: hold it for the whole launch."""
        return FolderLock(self.path, elsewhere=f"write elsewhere with {self.elsewhere}")

    def record(self) -> dict[str, Any]:
        """What `run.json` says (`{}` if absent or unreadable)."""
        try:
            record = read_document(self.path / STATE_NAME, STATE_NAME)
        except InputError:
            return {}
        return record if isinstance(record, dict) else {}

    def state(self) -> str:
        """`"fresh"` (no run), `"unfinished"`, `"finished"` or `"foreign"` (run files without a `config.yaml`)."""
        if not any((self.path / name).exists() for name in RUN_FILES):
            return "fresh"
        state_file = self.path / STATE_NAME
        if state_file.is_file():
            if self.record().get("status") == "finished":
                return "finished"
        elif (self.path / "export" / "model.safetensors").is_file():  # a run written before run.json existed
            return "finished"
        return "unfinished" if (self.path / "config.yaml").is_file() else "foreign"

    def decide_resume(self, resume: Any, config: Mapping[str, Any]) -> str | None:
        """The checkpoint a launch resumes from (None: a fresh start), or `FolderError` saying what to do instead.

        Args:
            resume: the run config's `resume` (`auto`, null, or a path).
            config: the launch's resolved config, compared with the `config.yaml` of an unfinished run here.
        """
        state, folder = self.state(), self.path
        elsewhere = f"or write elsewhere with {self.elsewhere}"
        explicit = None if resume in (*_NO_RESUME, "auto") else str(resume)
        other = self.record().get("command", "train")
        if state != "fresh" and other != self.command:
            raise FolderError(f"{folder} holds a run of `ssogvit {other}`, not of `ssogvit {self.command}`; write "
                              f"elsewhere with {self.elsewhere}", argument=str(folder))
        if state == "finished":
            raise FolderError(f"{folder} holds a finished run; evaluate it with `ssogvit eval --ckpt "
                              f"{folder / 'checkpoints' / 'best.ckpt'}`, {elsewhere}", argument=str(folder))
        if state == "foreign":
            present = [n for n in RUN_FILES if (folder / n).exists()]
            raise FolderError(f"{folder} holds files of another run ({', '.join(present)}) but no config.yaml; "
                              f"write elsewhere with {self.elsewhere}", argument=str(folder))
        if state == "fresh":
            return explicit
        try:
            saved = read_document(folder / "config.yaml", "config.yaml")
        except DocumentError as err:
            raise FolderError(f"{folder} holds a run whose config.yaml cannot be used ({err}); {elsewhere}",
                              argument=str(folder)) from None
        diff = config_diff(saved if isinstance(saved, Mapping) else {}, config, self.ignored)
        if diff:
            shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
            raise FolderError(f"{folder} holds a different run ({shown}); resume it with its own settings "
                              f"(its config.yaml), {elsewhere}", argument=str(folder))
        if resume in _NO_RESUME:
            raise FolderError(f"{folder} holds an unfinished run of this config; resume it with resume=auto, "
                              f"{elsewhere}", argument=str(folder))
        if explicit is not None:
            return explicit
        last = folder / "checkpoints" / "last.ckpt"
        return str(last) if last.is_file() else None

    @contextlib.contextmanager
    def claim(self, resume: Any, config: Mapping[str, Any]) -> Iterator[str | None]:
        """`with folder.claim(resume, config) as ckpt:` the launch's decision (`decide_resume`) taken before the
        lock, so that a refused launch writes nothing (not even the lock file), and again holding it, in case
        another launch came between."""
        self.decide_resume(resume, config)
        with self.lock():
            yield self.decide_resume(resume, config)

    def begin(self, write_config: Callable[[Path], Any], **facts: Any) -> None:
        """Start (or resume) the run, holding the lock: remove the temporary files killed writes left, write
        `config.yaml` with `write_config(tmp)` and mark the run `running`."""
        remove_stale_temp_files(self.path, subfolders=(".", "checkpoints", "export", "fit"))
        atomic_write(self.path / "config.yaml", write_config, overwrite=True)
        self.write_state("running", pid=os.getpid(), **facts)

    def write_state(self, status: str, **facts: Any) -> None:
        """`run.json`: the run's status (`running` / `finished`), its command and facts about it, atomically."""
        write_json(self.path / STATE_NAME, {"status": status, "command": self.command, **facts}, overwrite=True)
