"""A training run's folder: `ssogvit.outputs.RunFolder` for `train` and `transfer`, and what only training needs.

Besides the run's files (`config.yaml`, `checkpoints/`, `logs/`, `tb/`, `export/`, see `ssogvit.train.run`), the
folder holds two of its own (`ssogvit.outputs`):

    .ssogvit.lock  held with `fcntl.flock` by the live run writing to the folder; the OS releases it when that process
                   exits or dies, so a killed run never leaves a stale lock
    run.json       {"status": "running" | "finished", "command": "train", ...}: "finished" once the final
                   checkpoint and export are written

A launch may use a folder that holds no run, or resume the unfinished run of the same command it holds when the
configs match (`decide_resume`); anything else is a `RunFolderError` whose one line says how to resume or where to
write instead.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssogvit.outputs import IGNORED_KEYS, LOCK_NAME, RUN_FILES, STATE_NAME, FolderLock, RunFolder, atomic_write
from ssogvit.outputs import config_diff as config_diff
from ssogvit.outputs import remove_stale_temp_files as _remove_stale

from .errors import RunFolderError

__all__ = [
    "RunLock", "folder_state", "config_diff", "decide_resume", "remove_stale_temp_files", "prune_logs",
    "write_run_state", "fresh_folder", "RUN_FILES", "IGNORED_KEYS", "LOCK_NAME", "STATE_NAME",
]

#: `with RunLock(folder):` the run folder's lock (`ssogvit.outputs.FolderLock`)
RunLock = FolderLock


def folder_state(folder: str | Path) -> str:
    """`"fresh"` (no run), `"unfinished"`, `"finished"` or `"foreign"` (run files without a `config.yaml`)."""
    return RunFolder(folder, command="train").state()


def decide_resume(folder: Path, resume: Any, config: Mapping[str, Any], *, command: str = "train") -> str | None:
    """The checkpoint a launch of `command` into `folder` resumes from (None: a fresh start), or `RunFolderError`
    (`ssogvit.outputs.RunFolder.decide_resume`)."""
    return RunFolder(folder, command=command).decide_resume(resume, config)


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove the temporary files that writes killed mid-way left in the run folder (only names ssogvit gives)."""
    return _remove_stale(folder, subfolders=("checkpoints", "export", "."))


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


def write_run_state(folder: str | Path, status: str, *, command: str = "train", **facts: Any) -> None:
    """`run.json`: the run's status (`running` / `finished`), its command and facts about it, written atomically."""
    RunFolder(folder, command=command).write_state(status, **facts)


def fresh_folder(base: str | Path, *, parts: tuple[str, ...] = ()) -> Path:
    """`base`, or `base-2`, `base-3`, ... : the first whose `parts` (or itself) hold no run."""
    base = Path(base)
    for i in range(1, 10_000):
        candidate = base if i == 1 else base.with_name(f"{base.name}-{i}")
        if all(folder_state(candidate / p) == "fresh" for p in (parts or ("",))):
            return candidate
    raise RunFolderError(f"no free folder next to {base} (tried {base.name}-2 ... {base.name}-9999)")
