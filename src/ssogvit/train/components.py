"""The loggers, callbacks and progress output a run config selects (`logger`, `callbacks`, `progress` in
`ssogvit/conf/config.yaml`), built with Hydra's `instantiate` from their `_target_` classes."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError

__all__ = ["build_loggers", "build_callbacks", "progress_callbacks", "check_components"]


def _instantiate_group(cfg: DictConfig, group: str, *, output_dir: str | None = None) -> list[Any]:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if output_dir is not None:  # the folder as the run resolved it (`~` expanded), for `${output_dir}` in the group
        cfg = OmegaConf.merge(cfg, {"output_dir": output_dir})
    node = cfg.get(group) or {}
    out = []
    for key in node:
        try:
            out.append(instantiate(node[key]))
        except InstantiationException as err:
            cause = err.__cause__
            if isinstance(cause, ImportError):  # Lightning names the missing requirement and its pip command
                raise ConfigError(f"{group}={key} needs a package that is not installed: {cause}; install it, or "
                                  f"choose another {group} (e.g. {group}=[csv,tensorboard])"
                                  if group == "logger" else f"{group}={key}: {cause}") from None
            reason = str(cause or err).splitlines()[0]
            raise ConfigError(f"{group}.{key} cannot be built: {reason}") from None
    return out


def build_loggers(cfg: DictConfig, output_dir: Any) -> list[Any]:
    """The Lightning loggers of `cfg.logger`, writing under `output_dir` (none when `trainer.logger` is false)."""
    if not cfg.trainer.logger:
        return []
    return _instantiate_group(cfg, "logger", output_dir=str(output_dir))


def build_callbacks(cfg: DictConfig) -> list[Any]:
    """The extra Lightning callbacks of `cfg.callbacks` (`callbacks=[early_stopping]`)."""
    return _instantiate_group(cfg, "callbacks")


def progress_callbacks(cfg: DictConfig) -> tuple[bool, list[Any]]:
    """(`enable_progress_bar` for the Trainer, callbacks): Lightning's bar, `LineProgress` lines, or nothing."""
    from .progress import LineProgress, resolve_mode

    mode = resolve_mode(str(cfg.progress.mode))
    if not cfg.trainer.enable_progress_bar:
        mode = "none"
    if mode == "lines":
        return False, [LineProgress(every_n_steps=int(cfg.progress.every_n_steps))]
    return mode == "bar", []


def check_components(cfg: DictConfig) -> None:
    """Build the loggers, callbacks and progress output once, so that a missing package or a bad option is refused
    before the run writes anything (Lightning's loggers create their files only when they first log)."""
    from pathlib import Path

    build_loggers(cfg, Path(str(cfg.output_dir)).expanduser())
    build_callbacks(cfg)
    progress_callbacks(cfg)
