"""Evaluation images for the analyses: the validation split of a dataset, preprocessed as in training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ssogvit.errors import UsageError

_CONF = Path(__file__).resolve().parent.parent / "conf"


def data_config(dataset: str | None = None, ckpt: str | Path | None = None) -> dict[str, Any]:
    """The `data:` node a model was trained with: an export's own (sealed with its weights,
    `ssogvit.train.io.sealed_data_config`), else the run's `config.yaml` beside (or above) `ckpt` when there is one,
    else the packaged `conf/data/<dataset>.yaml` (default digits). A `dataset` named beside recorded data of another
    name is a `UsageError` (`--data`): it would be ignored."""
    recorded = _recorded_data(ckpt) if ckpt is not None else None
    if recorded is not None:
        if dataset is not None and dataset != recorded.get("name"):
            raise UsageError(f"--data {dataset}: {ckpt} records the data it was trained on ({recorded.get('name')}), "
                             "which analyze uses; leave --data out")
        return recorded
    from omegaconf import OmegaConf

    path = _CONF / "data" / f"{dataset or 'digits'}.yaml"
    if not path.is_file():
        raise ValueError(f"no data config for {dataset!r} (looked for {path})")
    return OmegaConf.to_container(OmegaConf.load(path).data, resolve=True)


def _recorded_data(ckpt: str | Path) -> dict[str, Any] | None:
    """The data settings recorded with `ckpt`: sealed in an export, or in the run's config.yaml beside or above it."""
    from ssogvit.documents import read_document
    from ssogvit.train.io import sealed_data_config

    sealed = sealed_data_config(ckpt)
    if sealed is not None:
        return dict(sealed)
    for parent in list(Path(ckpt).resolve().parents)[:3]:
        cfg_path = parent / "config.yaml"
        if cfg_path.is_file():  # a run folder may come from anyone: bounded, never interpolated
            cfg = read_document(cfg_path, "the run's config.yaml")
            if isinstance(cfg, dict) and isinstance(cfg.get("data"), dict):
                return dict(cfg["data"])
    return None


def validation_set(cfg: dict[str, Any], img_size: int | None = None, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """Validation images `(n, C, S, S)` and their targets at `img_size` (the config's by default), first `limit`:
    labels `(n,)` of a classification dataset, masks `(n, S, S)` of a segmentation one (docs/dense.md)."""
    from ssogvit.data import create_datamodule

    options = dict(cfg)
    name = options.pop("name")
    if img_size is not None:
        options["img_size"] = int(img_size)
    options["num_workers"] = 0
    dm = create_datamodule(name, **options)
    dm.setup("validate")
    dataset = dm.val_set
    n = len(dataset) if limit is None else min(limit, len(dataset))
    xs, ys = zip(*(dataset[i] for i in range(n)))
    targets = torch.stack(ys) if isinstance(ys[0], Tensor) else torch.tensor(ys)
    return torch.stack(xs), targets
