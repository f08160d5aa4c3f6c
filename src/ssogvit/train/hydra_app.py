"""One Hydra entry for the commands that run a composed config (`ssogvit train`, `ssogvit transfer`, ...).

`hydra_command(prog, argv, task)` gives a command Hydra's whole command line over the packaged config
(`ssogvit/conf`): overrides, `-m/--multirun` sweeps with any launcher (`hydra/launcher=submitit_slurm`), `--cfg job`,
`--resolve`, `--help`, `--info`. Each job's config reaches `task(cfg)`; a user error raised there (or by Hydra while
composing) propagates to the caller, which reports it in one or two lines (`ssogvit.errors.report_errors`).

Hydra's parser and runner are those of `hydra.main`, reached through `train._hydra_internal`, the one module that
uses Hydra's private API (pinned to the Hydra version it was written for; `hydra.main` itself cannot give one-line
usage errors or take flags and overrides in any order).

Where runs write (`hydra:` in `ssogvit/conf/config.yaml`): Hydra itself writes nothing into a single run's folder (the
run checks its folder before writing, see docs/training.md); in a sweep each job writes to its own folder,
`runs/multirun/<date>_<time>/<job number>/`, unless the sweep sets `output_dir`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import split_override

__all__ = ["hydra_command", "task_overrides"]


def task_overrides() -> list[str]:
    """The overrides given to this job on the command line (Hydra's `overrides.task`); none outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _job_config(cfg: DictConfig) -> DictConfig:
    """`cfg` with the folder of its job: a sweep job that sets no `output_dir` writes to Hydra's job folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    sets_output = any(split_override(o)[0] == "output_dir" for o in task_overrides())
    if hydra_cfg.mode == RunMode.MULTIRUN and not sets_output:
        OmegaConf.update(cfg, "output_dir", str(hydra_cfg.runtime.output_dir))
    return cfg


def _job_label() -> str:
    from hydra.core.hydra_config import HydraConfig

    return f"#{OmegaConf.select(HydraConfig.get(), 'job.num', default='?', throw_on_missing=False)}"


def _raise_failures(failures: list[tuple[str, BaseException]], *, multirun: bool) -> None:
    """Re-raise a run's error as it was; for a sweep, one error naming the failed jobs (a bug is raised as it is)."""
    from ssogvit.errors import user_errors

    from .errors import TrainError

    if not failures:
        return
    bugs = [err for _, err in failures if not isinstance(err, user_errors())]
    if bugs or not multirun:
        raise (bugs or [failures[0][1]])[0]
    by_message: dict[str, list[str]] = {}
    for label, err in failures:
        by_message.setdefault(str(err).splitlines()[0] if str(err) else type(err).__name__, []).append(label)
    parts = [f"job {', '.join(labels)}: {message}" for message, labels in by_message.items()]
    raise TrainError(f"{len(failures)} job(s) of the sweep failed (Hydra lists each job's overrides above); "
                     + "; ".join(parts))


def _usage_error(prog: str) -> Callable[[str], None]:
    def error(message: str) -> None:
        from .errors import ConfigError

        unknown = message.partition("unrecognized arguments: ")[2]
        if unknown:
            raise ConfigError(f"unknown option {unknown}; options are Hydra's and overrides are key=value (see "
                              f"`{prog} --help`)")
        raise ConfigError(f"{message} (see `{prog} --help`)")

    return error


def _check_overrides(overrides: Sequence[str]) -> None:
    """Refuse, naming it, an override that is not `key=value` or that Hydra's grammar cannot read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .config import quote_override
    from .errors import ConfigError

    bare = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bare:
        raise ConfigError(f"{bare[0]!r} is not an override key=value (e.g. experiment=digits_vit_ssog)")
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(quote_override(override))
        except Exception as err:  # noqa: BLE001 - Hydra's own grammar errors
            first = (str(err).splitlines() or [type(err).__name__])[0].split(" See https://")[0]
            raise ConfigError(f"{override!r} is not a valid override ({first}); quote a value with brackets or "
                              f"commas, e.g. 'key=\"[1, 2\"'") from None


def hydra_command(prog: str, argv: Sequence[str], task: Callable[[DictConfig], Any], *,
                  overrides: Sequence[str] = (), config_name: str = "config") -> int:
    """Run `task` on the config composed from `overrides` + `argv` with Hydra's command line; 0 when all jobs ran.

    Args:
        prog: the command as users type it (`ssogvit train`), shown by `--help`.
        argv: the command's arguments: Hydra flags and overrides in any order.
        task: called with each job's config (once for a run, once per job for `--multirun`); raises on failure.
        overrides: overrides the command adds before the user's (the user's win).
        config_name: the primary config in `ssogvit/conf`.
    """
    from hydra import version

    from ._hydra_internal import args_parser, run_hydra
    from .config import CONFIG_MODULE, quote_override

    version.setbase("1.3")  # as hydra.main(version_base="1.3"): the job keeps the working directory
    parser = args_parser()
    parser.prog = prog
    parser.error = _usage_error(prog)  # one line, not argparse's usage block
    args = parser.parse_intermixed_args(list(argv))  # flags and overrides in any order, as users type them
    _check_overrides(args.overrides)
    args.overrides = [quote_override(o) for o in (*overrides, *args.overrides)]

    main_pid, failures = os.getpid(), []

    def run_job(cfg: DictConfig) -> Any:
        try:
            return task(_job_config(cfg))
        except Exception as err:
            if os.getpid() != main_pid:  # a launcher's own process (submitit): Hydra hands the error back to this one
                raise
            failures.append((_job_label(), err))  # reported below in our words, not as Hydra's "Error executing job"
            return None

    # conf/hydra/launcher/submitit_slurm.yaml stands in for the plugin's config of that name (all its keys): Hydra
    # warns that it checks the file against the plugin's schema, which is what we want while it does
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/.*' is validated against ConfigStore schema")
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach the caller, which reports them in its own words
    try:
        run_hydra(args, parser, run_job, config_path=f"pkg://{CONFIG_MODULE}", config_name=config_name)
    except ValueError as err:  # Hydra's own checks of its flags (the jobs' errors are in `failures`)
        from .errors import ConfigError

        raise ConfigError(f"{err} (see `{prog} --help`)") from err
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
        sys.stdout.flush()
    _raise_failures(failures, multirun=bool(args.multirun))
    return 0
