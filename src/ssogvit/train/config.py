"""Hydra configuration: compose a run config from the packaged YAML (`ssogvit/conf`) and command-line overrides."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["compose", "quote_override", "list_experiments", "experiment_meta", "model_config_from", "CONFIG_MODULE",
           "PATH_KEYS"]

CONFIG_MODULE = "ssogvit.conf"
PATH_KEYS = ("resume", "output_dir", "data.root", "transfer.ckpt")  # values taken literally, whatever characters


def _hydra_quoted(value: str) -> str:
    """`value` as a single-quoted Hydra string that parses back to exactly `value` (no interpolation)."""
    out, backslashes = [], 0
    for ch in value:
        if ch == "\\":
            backslashes += 1
            continue
        if ch == "'":  # backslashes before a quote are escaped, and the quote itself
            out.append("\\" * (2 * backslashes) + "\\'")
        elif ch == "$":
            out.append("\\" * backslashes + "\\$")
        else:
            out.append("\\" * backslashes + ch)
        backslashes = 0
    out.append("\\" * (2 * backslashes))  # trailing backslashes precede the closing quote
    return "'" + "".join(out) + "'"


def quote_override(override: str) -> str:
    """`key=value` with `value` quoted for Hydra where it holds characters Hydra's grammar would read otherwise.

    A path key (`PATH_KEYS`) is taken literally (`resume=/runs/x/checkpoints/step=0000100.ckpt`, commas, brackets,
    quotes) unless it parses as it is (so `output_dir=runs/${name}` still interpolates); any other value is quoted
    only when it holds a `=` and does not parse as it is.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key, sep, value = override.partition("=")
    if not sep or value[:1] in ("'", '"') or key.startswith("~"):
        return override
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_override(override).value()
    except Exception:  # noqa: BLE001 - Hydra raises its own exception types for a grammar error
        parsed = None
        ok = False
    else:
        ok = True
    if key.lstrip("+") in PATH_KEYS:
        literal = ok and (parsed == value or (parsed is None and value.lower() == "null"))
        return override if literal else f"{key}={_hydra_quoted(value)}"
    return override if ok or "=" not in value else f"{key}={_hydra_quoted(value)}"


def compose(overrides: Sequence[str] = (), *, config_name: str = "config") -> DictConfig:
    """The run config for `overrides` (Hydra syntax: `experiment=cifar100_vit_base_ssog`, `data.batch_size=32`).

    When `experiment=<name>` is given and `name` is not overridden, the run is named after the experiment.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    overrides = [quote_override(o) for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    exp = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "experiment"), None)
    if exp and not any(o.split("=", 1)[0].lstrip("+") == "name" for o in overrides):
        OmegaConf.update(cfg, "name", exp.split("/")[-1], force_add=True)
    return cfg


def list_experiments() -> list[str]:
    """Names of the packaged experiment configs (`ssogvit train experiment=<name>`)."""
    folder = resources.files(CONFIG_MODULE) / "experiment"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def experiment_meta(name: str) -> dict[str, Any]:
    """The `meta` block (paper table, description) of an experiment, read without composing it."""
    text = (resources.files(CONFIG_MODULE) / "experiment" / f"{name}.yaml").read_text()
    node = OmegaConf.create(text)
    return dict(OmegaConf.to_container(node.get("meta", {}), resolve=False) or {})


def model_config_from(cfg: DictConfig) -> dict[str, Any]:
    """`create_model` arguments of a run config: `{"name": ..., **kwargs}` with the null kwargs left out."""
    kwargs = OmegaConf.to_container(cfg.model.kwargs, resolve=True)
    out: dict[str, Any] = {"name": str(cfg.model.name)}
    for key, value in kwargs.items():
        if value is None:
            continue
        out[key] = tuple(value) if key == "steer" and isinstance(value, list) else value
    return out
