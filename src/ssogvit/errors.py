"""`UsageError`: a command's input that it refuses, reported by `ssogvit` in one or two lines with exit status 2;
`ArgumentParser`: argparse whose errors are `UsageError`s (one line, not argparse's usage block)."""

from __future__ import annotations

import argparse

__all__ = ["UsageError", "ArgumentParser"]


class UsageError(Exception):
    """Bad input to a command (a file it cannot use, an option it does not take); the message names the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors raise `UsageError("<problem> (see `prog --help`)")`."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")
