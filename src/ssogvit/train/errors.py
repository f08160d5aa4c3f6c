"""Errors of the training pipeline that the command line reports in one or two lines (exit status 2): each a
`ssogvit.errors.UserError`, the one base class the reporter catches."""

from __future__ import annotations

from ssogvit.errors import UserError
from ssogvit.outputs import OutputError

__all__ = ["TrainError", "CheckpointError", "RunFolderError", "NonFiniteError", "ConfigError"]


class TrainError(UserError, RuntimeError):
    """A launch or a file the pipeline refuses; the message says what was wrong and what to do instead."""


class CheckpointError(TrainError):
    """A checkpoint or export cannot be read (missing, truncated, corrupt, refused, not ours or out of limits)."""


class RunFolderError(OutputError):
    """The output folder holds a finished or different run, or another live run is writing to it
    (`ssogvit.train.run_folder`); an output the launch may not write, like the other `OutputError`s."""


class NonFiniteError(TrainError):
    """The loss or the weights became non-finite: the run diverged and was stopped."""


class ConfigError(TrainError):
    """The composed run config cannot describe a run (bad override, unknown option, value out of range)."""
