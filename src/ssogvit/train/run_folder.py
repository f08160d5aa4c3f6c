"""A run folder belongs to one run: what it holds, who writes to it, and whether a launch may use it.

Besides the run's files (`config.yaml`, `checkpoints/`, `logs/`, `tb/`, `export/`, see `ssogvit.train.run`), the
folder holds two of its own:

    .lock      held with `fcntl.flock` by the live run writing to the folder; the OS releases it when that process
               exits or dies, so a killed run never leaves a stale lock
    run.json   {"status": "running" | "finished", ...}: "finished" once the final checkpoint and export are written

A launch may use a folder that holds no run, or resume the unfinished run it holds when the configs match
(`decide_resume`); anything else is a `RunFolderError` whose one line says how to resume or where to write instead.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import RunFolderError

__all__ = [
    "RunLock", "folder_state", "config_diff", "decide_resume", "remove_stale_temp_files", "prune_logs",
    "write_run_state", "fresh_folder", "RUN_FILES", "IGNORED_KEYS",
]

RUN_FILES = ("config.yaml", "run.json", "checkpoints", "export", "logs", "tb")
# Keys that may differ between the launches of one run: where things are, not what is computed.
IGNORED_KEYS = ("resume", "output_dir", "data.root", "data.num_workers", "data.pin_memory",
                "trainer.enable_progress_bar", "trainer.log_every_n_steps", "trainer.logger", "logger", "progress",
                "cluster")
LOCK_NAME, STATE_NAME = ".lock", "run.json"


class RunLock:
    """`with RunLock(folder):` holds an exclusive `flock` on `folder/.lock` (created with the folder if needed).

    Raises `RunFolderError` at once if another live process holds it.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunFolderError(f"another live run (pid {holder}) is writing to {self.folder}; wait for it to end "
                                 f"or write elsewhere with output_dir=<new folder>") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def folder_state(folder: str | Path) -> str:
    """`"fresh"` (no run), `"unfinished"`, `"finished"` or `"foreign"` (run files without a `config.yaml`)."""
    folder = Path(folder)
    if not any((folder / name).exists() for name in RUN_FILES):
        return "fresh"
    state_file = folder / STATE_NAME
    if state_file.is_file():
        try:
            status = json.loads(state_file.read_text()).get("status")
        except (ValueError, AttributeError):
            status = None
        if status == "finished":
            return "finished"
    elif (folder / "export" / "model.safetensors").is_file():  # a run written before run.json existed
        return "finished"
    return "unfinished" if (folder / "config.yaml").is_file() else "foreign"


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(node) if isinstance(node, tuple) else node}


def config_diff(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`"key: saved A, now B"` for each key (dotted) that differs, `IGNORED_KEYS` and their children left out."""
    a, b = _flatten(saved), _flatten(new)
    ignored = tuple(IGNORED_KEYS)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in ignored or key.startswith(tuple(k + "." for k in ignored)):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: saved {a.get(key, '<absent>')!r}, now {b.get(key, '<absent>')!r}")
    return out


def decide_resume(folder: Path, resume: Any, config: Mapping[str, Any]) -> str | None:
    """The checkpoint a launch into `folder` resumes from (None: a fresh start), or `RunFolderError`.

    Args:
        resume: the run config's `resume` (`auto`, null, or a path).
        config: the launch's resolved config, compared with the `config.yaml` of an unfinished run in `folder`.
    """
    from omegaconf import OmegaConf

    state = folder_state(folder)
    elsewhere = "or write elsewhere with output_dir=<new folder>"
    explicit = None if resume in (None, False, "null", "none", "false", "auto") else str(resume)
    if state == "finished":
        raise RunFolderError(f"{folder} holds a finished run; evaluate it with `ssogvit eval --ckpt "
                             f"{folder / 'checkpoints' / 'best.ckpt'}`, {elsewhere}")
    if state == "foreign":
        present = [n for n in RUN_FILES if (folder / n).exists()]
        raise RunFolderError(f"{folder} holds files of another run ({', '.join(present)}) but no config.yaml; "
                             f"write elsewhere with output_dir=<new folder>")
    if state == "fresh":
        return explicit
    diff = config_diff(OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False), config)
    if diff:
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        raise RunFolderError(f"{folder} holds a different run ({shown}); resume it with its own settings "
                             f"(its config.yaml), {elsewhere}")
    last = folder / "checkpoints" / "last.ckpt"
    if resume in (None, False, "null", "none", "false"):
        raise RunFolderError(f"{folder} holds an unfinished run of this config; resume it with resume=auto, "
                             f"{elsewhere}")
    if explicit is not None:
        return explicit
    return str(last) if last.is_file() else None


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove the `.*.tmp` files that writes killed mid-way left in the folder (call it holding the folder's lock)."""
    removed = []
    for sub in ("checkpoints", "export", "."):
        d = Path(folder) / sub
        for path in d.glob(".*.tmp") if d.is_dir() else ():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def prune_logs(folder: str | Path, *, epoch: int, step: int) -> None:
    """Drop from the CSV logs of earlier launches the rows a resume from (`epoch`, `step`) will log again.

    Rows logged with an epoch are kept up to `epoch` (the checkpoint's last completed epoch; -1 for a start from
    scratch), rows without one (learning rate) below `step`. The TensorBoard event files are left as they are.
    """
    from .io import atomic_write

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

        atomic_write(path, write)


def write_run_state(folder: str | Path, status: str, **facts: Any) -> None:
    """`run.json`: the run's status (`running` / `finished`) and facts about it, written atomically."""
    from .io import atomic_write

    text = json.dumps({"status": status, **facts}, indent=2, default=str)
    atomic_write(Path(folder) / STATE_NAME, lambda tmp: Path(tmp).write_text(text))


def fresh_folder(base: str | Path, *, parts: tuple[str, ...] = ()) -> Path:
    """`base`, or `base-2`, `base-3`, ... : the first whose `parts` (or itself) hold no run."""
    base = Path(base)
    for i in range(1, 10_000):
        candidate = base if i == 1 else base.with_name(f"{base.name}-{i}")
        if all(folder_state(candidate / p) == "fresh" for p in (parts or ("",))):
            return candidate
    raise RunFolderError(f"no free folder next to {base} (tried {base.name}-2 ... {base.name}-9999)")
