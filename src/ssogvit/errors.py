"""`UsageError`: a command's input that it refuses, reported by `ssogvit` in one or two lines with exit status 2."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input to a command (a file it cannot use, an option it does not take); the message names the fix."""

