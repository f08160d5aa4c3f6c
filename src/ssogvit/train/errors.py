"""Errors of the training pipeline that the command line reports in one or two lines (exit status 2)."""

from __future__ import annotations

from ssogvit.outputs import FolderError

__all__ = ["TrainError", "CheckpointError", "RunFolderError", "NonFiniteError", "ConfigError"]


class TrainError(RuntimeError):
    """A launch or a file the pipeline refuses; the message says what was wrong and what to do instead."""


class CheckpointError(TrainError):
    """A checkpoint or export cannot be read (missing, truncated, corrupt, refused, not ours or out of limits)."""


#: the output folder holds a finished or different run, or another live run is writing to it (`ssogvit.outputs`)
RunFolderError = FolderError


class NonFiniteError(TrainError):
    """The loss or the weights became non-finite: the run diverged and was stopped."""


class ConfigError(TrainError):
    """The composed run config cannot describe a run (bad override, unknown option, value out of range)."""
