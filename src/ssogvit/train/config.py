"""Hydra configuration: compose a run config from the packaged YAML (`ssogvit/conf`) and command-line overrides."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ssogvit.errors import InputError
from ssogvit.specs import Spec

from .errors import ConfigError
from .settings import check_values, register_run_defaults, rules

__all__ = [
    "compose", "quote_override", "split_override", "list_experiments", "experiment_meta", "experiment_rows",
    "unset_details",
    "model_config_from", "IncompleteExperimentError", "CONFIG_MODULE", "PATH_KEYS", "check_run_config",
    "RUN_CONFIG_RULES", "check_complete",
]

CONFIG_MODULE = "ssogvit.conf"
# the declared defaults (`ssogvit.train.settings`) that conf/config.yaml composes onto, for every Hydra entry that
# composes from CONFIG_MODULE (`compose` below, `hydra_app`): both import this module first
register_run_defaults()
# values taken literally, whatever characters they hold
PATH_KEYS = ("resume", "output_dir", "data.root", "transfer.ckpt", "convert.teacher", "convert.calib")


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


def split_override(override: str) -> tuple[str, str | None]:
    """The one reading of `KEY=VALUE` (a Hydra override, or an option such as `--model-kw`): `(KEY, VALUE)`, the key
    without Hydra's prefixes (`+data.root=/x` -> `data.root`, `~ema` -> `ema`), the value as written (`None` without
    a `=`)."""
    key, sep, value = override.partition("=")
    return key.lstrip("+~"), value if sep else None


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


class IncompleteExperimentError(ConfigError):
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

    overrides = [quote_override(o) for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    exp = next((value for key, value in map(split_override, overrides) if key == "experiment"), None)
    if exp and not any(split_override(o)[0] == "name" for o in overrides):
        OmegaConf.update(cfg, "name", exp.split("/")[-1], force_add=True)
    if not allow_unset:
        check_complete(cfg)
    return cfg


def check_complete(cfg: DictConfig) -> None:
    """Raise `IncompleteExperimentError` if a key of the experiment's `meta.missing` is still null."""
    unset = unset_details(cfg)
    if unset:
        raise IncompleteExperimentError(
            f"{', '.join(unset)} not set: the paper does not give them for experiment {cfg.name!r} (see its "
            f"meta.description); pass them as overrides, e.g. {unset[0]}=<value>"
        )


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
    """`create_model` arguments of a run config: `{"name": ..., **kwargs}` with the null kwargs left out (lists as
    YAML gives them: `create_model` records a `steer` list as a tuple)."""
    kwargs = OmegaConf.to_container(cfg.model.kwargs, resolve=True)
    out: dict[str, Any] = {"name": str(cfg.model.name)}
    for key, value in kwargs.items():
        if value is None:
            continue
        out[key] = value
    return out


# The run config's values, checked before a launch writes anything (`check_run_config`), by the specs declared with
# each setting in `ssogvit.train.settings` (the declarations of `ssogvit.specs`: `data.img_size` is `create_model`'s
# `img_size` and `eval --img-size`). Lightning, timm and torch refuse most of these too, but only once training has
# started, and with a traceback. The model's own values (`model.kwargs.*`) are checked by its constructor.
RUN_CONFIG_RULES: dict[str, Spec] = rules()


def check_run_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` naming the first value of `cfg` that its declared spec refuses (`RUN_CONFIG_RULES`), a key
    added to a closed section (`+optim.momentum=0.9`), settings that contradict each other (`settings.CONSTRAINTS`),
    an unknown optimizer or an empty `output_dir`."""
    try:
        check_values(cfg)
    except InputError as err:
        raise ConfigError(str(err)) from None
    from timm.optim import list_optimizers

    if str(cfg.optim.opt).lower() not in list_optimizers():
        raise ConfigError(f"optim.opt={cfg.optim.opt!r} is not a timm optimizer (e.g. adamw, sgd, lamb)")
    if not str(cfg.output_dir).strip():
        raise ConfigError("output_dir is empty: give the run a folder (default runs/<name>)")
