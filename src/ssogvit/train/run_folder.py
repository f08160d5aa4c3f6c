"""A run's folder: what a folder that belongs to one run of one command (`train`, `transfer`, `convert`) holds, who
writes to it and when a launch may use it (docs/training.md, "A run folder belongs to one run").

Besides the run's files (`config.yaml`, `checkpoints/`, `logs/`, `tb/`, `export/`, see `ssogvit.train.run`), the
folder holds two of its own:

    .ssogvit.lock  held with `fcntl.flock` by the live run writing to the folder (`FolderLock`); the OS releases it
                   when that process exits or dies, so a killed run never leaves a stale lock
    run.json       {"status": "running" | "finished", "command": "train", ...}: "finished" once the final
                   checkpoint and export are written

A launch may use a folder that holds no run, or resume the unfinished run of the same command it holds when the
configs match (`RunFolder.decide_resume`); anything else is a `RunFolderError` whose one line says how to resume or
where to write instead. Every file is written through `ssogvit.outputs` (atomic, temporaries of dead writers
removed).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ssogvit.documents import DocumentError, read_document
from ssogvit.errors import InputError
from ssogvit.outputs import HOST, RUN_STATE_FILE, atomic_write, remove_stale_temp_files, write_json

from .errors import RunFolderError

__all__ = [
    "FolderLock", "RunFolder", "RunFolderError", "config_diff", "EXTEND_KEYS", "RESUME_WORDS", "folder_state",
    "fresh_folder", "prune_logs", "resume_may_change",
    "RUN_FILES", "IGNORED_KEYS", "LOCK_NAME", "STATE_NAME",
]

LOCK_NAME, STATE_NAME = ".ssogvit.lock", RUN_STATE_FILE
#: what makes a folder hold a run (anything else in it is left alone)
RUN_FILES = ("config.yaml", "run.json", "checkpoints", "export", "logs", "tb", "fit")
#: run-config keys that may differ between the launches of one run: where things are, not what is computed
#: the run-config keys a launch with `resume=extend` may raise: how long the run trains, nothing of what it computes
EXTEND_KEYS = ("trainer.max_epochs", "trainer.max_steps")
#: the words `resume` takes besides a checkpoint's path (and null): docs/training.md, "A run folder belongs to one run"
RESUME_WORDS = ("auto", "extend", "new")
IGNORED_KEYS = ("resume", "output_dir", "data.root", "data.num_workers", "data.pin_memory",
                "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.logger", "logger", "progress",
                "cluster")


def resume_may_change(resume: Any, ignored: Sequence[str] = IGNORED_KEYS) -> tuple[str, ...]:
    """The one declaration of what a resume may change of the run's recorded config (docs/training.md, "A run folder
    belongs to one run"): where things are and how they are shown (`ignored`), and with `resume=extend` or a
    checkpoint's path (the run continued, maybe elsewhere) how long it trains (`EXTEND_KEYS`). Anything else would
    be recorded but not obeyed (the checkpoint's optimizer state holds the old learning rate): refused."""
    return (*ignored, *EXTEND_KEYS) if resume not in (*_NO_RESUME, "auto", "new") else tuple(ignored)


class FolderLock:
    """`with FolderLock(folder):` holds an exclusive `flock` on `folder/.ssogvit.lock` (creating both if needed).

    Raises `RunFolderError` at once if another live process holds it, or if the lock file there was not written by
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
            raise RunFolderError(f"another live run ({holder}) is writing to {self.folder}; wait for it to end "
                                 f"or {self.elsewhere}", argument=str(self.folder)) from None
        held = os.read(fd, 200).decode(errors="replace")
        if held.strip() and not held.startswith("ssogvit "):
            os.close(fd)
            raise RunFolderError(f"{self.path} exists and was not written by ssogvit; it was left as it is: "
                                 f"{self.elsewhere}", argument=str(self.folder))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"ssogvit pid {os.getpid()} on {HOST}\n".encode(), 0)
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


def config_diff(saved: Mapping[str, Any], new: Mapping[str, Any], ignored: Sequence[str] = IGNORED_KEYS,
                labels: tuple[str, str] = ("saved", "now")) -> list[str]:
    """`"key: saved A, now B"` (`labels`) for each key (dotted) that differs, `ignored` keys and their children left
    out."""
    a, b = _flatten(saved), _flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in ignored or key.startswith(tuple(k + "." for k in ignored)):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: {labels[0]} {a.get(key, '<absent>')!r}, {labels[1]} {b.get(key, '<absent>')!r}")
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
        """The checkpoint a launch resumes from (None: a fresh start), or `RunFolderError` saying what to do instead.

        Args:
            resume: the run config's `resume`: `auto`, `extend` (a finished run trained longer: only `EXTEND_KEYS`
                may differ, and one of them must grow), `new` (the caller chose a fresh folder: as null), null, or a
                path.
            config: the launch's resolved config, compared with the `config.yaml` of the run here.
        """
        state, folder = self.state(), self.path
        elsewhere = f"or write elsewhere with {self.elsewhere}"
        explicit = None if resume in (*_NO_RESUME, *RESUME_WORDS) else str(resume)
        other = self.record().get("command", "train")
        longer = self.command in ("train", "transfer")  # the commands whose runs `extend` and `new` apply to
        if resume in ("extend", "new") and not longer:
            raise RunFolderError(f"resume={resume} is for the runs of `ssogvit train` and `ssogvit transfer`, not "
                                 f"of `ssogvit {self.command}`; {self.elsewhere} names a new folder",
                                 argument="resume")
        if state != "fresh" and other != self.command:
            raise RunFolderError(f"{folder} holds a run of `ssogvit {other}`, not of `ssogvit {self.command}`; write "
                                 f"elsewhere with {self.elsewhere}", argument=str(folder))
        if state == "finished" and resume != "extend":
            raise RunFolderError(f"{folder} holds a finished run; evaluate it with `ssogvit eval --ckpt "
                                 f"{folder / 'checkpoints' / 'best.ckpt'}`, "
                                 + ("train it longer with resume=extend and a larger trainer.max_epochs, start a new "
                                    "try beside it with resume=new, " if longer else "") + elsewhere,
                                 argument=str(folder))
        if state == "foreign":
            present = [n for n in RUN_FILES if (folder / n).exists()]
            raise RunFolderError(f"{folder} holds files of another run ({', '.join(present)}) but no config.yaml; "
                                 f"write elsewhere with {self.elsewhere}", argument=str(folder))
        if state == "fresh":
            if resume == "extend":
                raise RunFolderError(f"{folder} holds no run to extend (resume=extend trains a finished run "
                                     f"longer); start it with resume=auto", argument=str(folder))
            return explicit
        try:
            saved = read_document(folder / "config.yaml", "config.yaml")
        except DocumentError as err:
            raise RunFolderError(f"{folder} holds a run whose config.yaml cannot be used ({err}); {elsewhere}",
                                 argument=str(folder)) from None
        saved = saved if isinstance(saved, Mapping) else {}
        diff = config_diff(saved, config, resume_may_change(resume, self.ignored))
        if diff:
            shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
            raise RunFolderError(f"{folder} holds a different run ({shown}); resume it with its own settings "
                                 f"(its config.yaml), {'start a new try with resume=new, ' if longer else ''}"
                                 f"{elsewhere}", argument=str(folder))
        if resume in (*_NO_RESUME, "new"):
            raise RunFolderError(f"{folder} holds an unfinished run of this config; resume it with resume=auto, "
                                 f"{elsewhere}", argument=str(folder))
        if explicit is not None:
            return explicit
        last = folder / "checkpoints" / "last.ckpt"
        if resume == "extend" and state == "finished":
            _check_longer(saved, config, folder)
            if not last.is_file():
                raise RunFolderError(f"{folder} holds a finished run without checkpoints/last.ckpt: it cannot be "
                                     f"extended; {elsewhere}", argument=str(folder))
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
        write_json(self.path / STATE_NAME, {"status": status, "command": self.command, **facts}, overwrite=True,
                   default=str)


def _check_longer(saved: Mapping[str, Any], config: Mapping[str, Any], folder: Path) -> None:
    """`RunFolderError` unless `config` trains longer than the finished run `saved`: a larger `trainer.max_epochs`,
    or a larger `trainer.max_steps` (-1 or absent: no step limit)."""
    a, b = _flatten(saved), _flatten(config)

    def grows(key: str) -> bool:
        old, new = a.get(key), b.get(key)
        if new in (None, -1) or old == new:
            return old not in (None, -1) and new in (None, -1)  # a step limit lifted
        return old not in (None, -1) and int(new) > int(old)

    if not any(grows(k) for k in EXTEND_KEYS):
        raise RunFolderError(f"resume=extend trains the finished run in {folder} longer: give a trainer.max_epochs "
                             f"above its {a.get('trainer.max_epochs')} (or a larger trainer.max_steps)",
                             argument="trainer.max_epochs")


def folder_state(folder: str | Path) -> str:
    """`"fresh"` (no run), `"unfinished"`, `"finished"` or `"foreign"` (run files without a `config.yaml`)."""
    return RunFolder(folder, command="train").state()


def prune_logs(folder: str | Path, *, epoch: int, step: int) -> None:
    """Drop from the CSV logs of earlier launches the rows a resume from (`epoch`, `step`) will log again.

    Rows logged with an epoch are kept up to `epoch` (the checkpoint's last completed epoch; -1 for a start from
    scratch), rows without one (learning rate) below `step`. The TensorBoard event files are left as they are.
    """
    for path in sorted(Path(folder).glob("logs/version_*/metrics.csv")):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames or [], list(reader)

        def keep(row: dict[str, str | None]) -> bool:
            if None in row.values() or None in row:  # a line torn by a kill
                return False
            try:
                if row.get("epoch"):
                    return int(float(row["epoch"])) <= epoch
                return int(float(row["step"] or 0)) < step
            except ValueError:
                return False

        kept = [r for r in rows if keep(r)]
        if len(kept) == len(rows):
            continue

        def write(tmp: str, kept=kept, fields=fields) -> None:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(kept)

        atomic_write(path, write, overwrite=True)


def fresh_folder(base: str | Path, *, parts: tuple[str, ...] = ()) -> Path:
    """`base`, or `base-2`, `base-3`, ... : the first that holds no run, itself or in any of its `parts`."""
    base = Path(base)
    for i in range(1, 10_000):
        candidate = base if i == 1 else base.with_name(f"{base.name}-{i}")
        if all(folder_state(candidate / p) == "fresh" for p in ("", *parts)):
            return candidate
    raise RunFolderError(f"no free folder next to {base} (tried {base.name}-2 ... {base.name}-9999)")
