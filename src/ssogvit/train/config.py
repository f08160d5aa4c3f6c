"""Hydra configuration: compose a run config from the packaged YAML (`ssogvit/conf`) and command-line overrides."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "compose", "list_experiments", "experiment_meta", "experiment_rows", "unset_details", "model_config_from",
    "IncompleteExperimentError", "CONFIG_MODULE",
]

CONFIG_MODULE = "ssogvit.conf"


class IncompleteExperimentError(ValueError):
    """An experiment whose paper does not give some of its settings (`meta.missing`), and the run did not set them."""


def compose(overrides: Sequence[str] = (), *, config_name: str = "config", allow_unset: bool = False) -> DictConfig:
    """The run config for `overrides` (Hydra syntax: `experiment=cifar100_vit_base_ssog`, `data.batch_size=32`).

    When `experiment=<name>` is given and `name` is not overridden, the run is named after the experiment.

    Raises:
        IncompleteExperimentError: a key of the experiment's `meta.missing` (a detail the paper's text lacks) is still
            null; `allow_unset=True` returns such a config anyway (to print or inspect it, never to train).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    exp = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "experiment"), None)
    if exp and not any(o.split("=", 1)[0].lstrip("+") == "name" for o in overrides):
        OmegaConf.update(cfg, "name", exp.split("/")[-1], force_add=True)
    unset = unset_details(cfg)
    if unset and not allow_unset:
        raise IncompleteExperimentError(
            f"{', '.join(unset)} not set: the paper does not give them for experiment {cfg.name!r} (see its "
            f"meta.description); pass them as overrides, e.g. {unset[0]}=<value>"
        )
    return cfg


def list_experiments() -> list[str]:
    """Names of the packaged experiment configs (`ssogvit train experiment=<name>`)."""
    folder = resources.files(CONFIG_MODULE) / "experiment"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def experiment_meta(name: str) -> dict[str, Any]:
    """The `meta` block of an experiment (`paper` label, `description`, `rows`: the paper rows it reproduces with the
    paper's Acc@1, `missing`: settings the paper's text lacks), read without composing it."""
    text = (resources.files(CONFIG_MODULE) / "experiment" / f"{name}.yaml").read_text()
    node = OmegaConf.create(text)
    return dict(OmegaConf.to_container(node.get("meta", {}), resolve=False) or {})


def experiment_rows(table: int | None = None) -> list[dict[str, Any]]:
    """The paper rows that the experiment configs reproduce (`meta.rows`), each with its experiment's name.

    Args:
        table: only the rows of this paper table.

    Returns:
        `{"experiment", "table", "row", "top1"}` dicts (`top1`: the paper's Acc@1, `None` where our copy of the text
        lacks it), ordered by table, then as listed in the configs.
    """
    out = []
    for name in list_experiments():
        for row in experiment_meta(name).get("rows") or []:
            if table is None or int(row["table"]) == table:
                out.append(
                    {"experiment": name, "table": int(row["table"]), "row": str(row["row"]), "top1": row["top1"]}
                )
    return sorted(out, key=lambda r: r["table"])


def unset_details(cfg: DictConfig) -> list[str]:
    """Keys of the experiment's `meta.missing` (settings the paper's text lacks) that are still null in `cfg`."""
    missing = OmegaConf.select(cfg, "meta.missing", default=None) or []
    return [str(key) for key in missing if OmegaConf.select(cfg, str(key), default=None) is None]


def model_config_from(cfg: DictConfig) -> dict[str, Any]:
    """`create_model` arguments of a run config: `{"name": ..., **kwargs}` with the null kwargs left out."""
    kwargs = OmegaConf.to_container(cfg.model.kwargs, resolve=True)
    out: dict[str, Any] = {"name": str(cfg.model.name)}
    for key, value in kwargs.items():
        if value is None:
            continue
        out[key] = tuple(value) if key == "steer" and isinstance(value, list) else value
    return out
