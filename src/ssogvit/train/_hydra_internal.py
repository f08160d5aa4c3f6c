"""The one place that reaches into Hydra's private API (``hydra._internal.utils``), written for hydra-core
``WRITTEN_FOR``: ``tests/test_private_apis.py`` fails on any other installed version, so that an upgrade is checked here
first.

Why not Hydra's public entry points: ``hydra.main`` parses ``sys.argv`` itself with argparse's own error (a usage block
and exit 2, where our commands answer in one line, ``train.hydra_app``) and without letting flags and overrides mix
in any order; ``hydra.initialize_config_dir`` + ``compose`` has no ``--multirun``, launchers, ``--cfg`` or ``--help``.
``hydra.main`` is these two functions: the parser it builds, and the runner it hands the parsed arguments to.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

__all__ = ["WRITTEN_FOR", "args_parser", "run_hydra"]

#: The hydra-core version (``hydra.__version__``) whose private functions below were read and tested.
WRITTEN_FOR = "1.3.8"


def args_parser() -> argparse.ArgumentParser:
    """Hydra's command-line parser, as ``hydra.main`` builds it (flags, ``overrides`` positional)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def run_hydra(args: argparse.Namespace, parser: argparse.ArgumentParser, task: Callable[[DictConfig], Any], *,
              config_path: str, config_name: str) -> None:
    """What ``hydra.main`` does with the parsed ``args``: compose, then run ``task`` once, or once per job of a
    sweep through the configured launcher (or print the config, help or info the flags ask for)."""
    from hydra._internal.utils import _run_hydra

    _run_hydra(args=args, args_parser=parser, task_function=task, config_path=config_path, config_name=config_name)
