"""``create_model`` / ``list_models``: every family x size x mixer by name, also registered with timm.

Names are ``"{family}-{size}-{mixer}"``, e.g. ``"vit-small-ssog"``, ``"looped-base-mha"``, ``"ode-base-ssog-steered"``.
In timm the same models are ``"ssogvit_{family}_{size}_{mixer}"`` with ``-`` written ``_``
(``timm.create_model("ssogvit_vit_small_ssog", num_classes=100)``) once ``ssogvit.models`` is imported.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import timm
from safetensors import safe_open
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import (PretrainedCfg, build_model_with_cfg, generate_default_cfgs, register_model,
                         resolve_pretrained_cfg)
from torch import Tensor, nn

import torch

from ssogvit.documents import MAX_PARAMETERS, DocumentError, check_no_interpolation, read_document
from ssogvit.errors import InputError
from ssogvit.resources import format_bytes
from ssogvit.layers import list_mixers, mixer_option_defaults, mixer_options

from ._common import SAVED_FOLDER_CHECK, SIZES, VisionTransformerBase
from .dense import NUM_LEVELS, PyramidViT, SegmentationModel, check_pyramid_patch, pyramid_scales
from .pretrained import carry_state_dict, target_model
from .looped import LoopedViT
from .ode import ODEViT
from .sealed import file_config, header_config, verify
from .vit import VisionTransformer

__all__ = [
    "FAMILIES", "SIZES", "TASKS", "check_model_config", "create_model", "create_segmentation_model", "from_pretrained",
    "list_models", "load_weights", "model_options", "parse_model_name", "read_weights", "sealed_config", "timm_name",
]

#: what a model predicts: ``None`` (an image classifier) or ``"segmentation"`` (per-pixel classes, docs/dense.md)
TASKS = (None, "segmentation")
#: options of a segmentation model beyond its backbone's (``SegmentationModel``)
SEGMENTATION_OPTIONS = ("pyramid_dim", "head_dim", "feature_blocks")

#: family name -> model class
FAMILIES: dict[str, type[VisionTransformerBase]] = {"vit": VisionTransformer, "looped": LoopedViT, "ode": ODEViT}

_SET_BY_NAME = ("mixer", "mixer_options", "name")


def parse_model_name(name: str) -> tuple[str, str, str]:
    """``"{family}-{size}-{mixer}"`` -> ``(family, size, mixer)``; a ``ValueError`` names what is wrong."""
    parts = name.split("-", 2) if isinstance(name, str) else []
    if len(parts) != 3:
        raise ValueError(f"model name {name!r} is not '{{family}}-{{size}}-{{mixer}}'; see list_models()")
    family, size, mixer = parts
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} in {name!r}; expected one of {list(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} in {name!r}; expected one of {list(SIZES)}")
    if mixer not in list_mixers():
        raise ValueError(f"unknown mixer {mixer!r} in {name!r}; expected one of {list_mixers()}")
    return family, size, mixer


def model_options(family: str) -> list[str]:
    """Keyword options of a family's constructor that ``create_model`` accepts (mixer options come on top)."""
    cls = FAMILIES[family]
    params = inspect.signature(cls.__init__).parameters.values()
    shared = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.name not in _SET_BY_NAME]
    return [*shared, *cls.family_options]


def create_model(name: str, *, task: str | None = None, **kwargs: Any) -> nn.Module:
    """Build a model by name.

    Args:
        name: ``"{family}-{size}-{mixer}"``; family ``vit`` / ``looped`` / ``ode``, size ``tiny`` (192/3), ``small``
            (384/6), ``medium`` (576/9), ``base`` (768/12), ``large`` (1024/16, depth 24), mixer from
            ``ssogvit.layers.list_mixers()``.
        **kwargs: model options (``num_classes``, ``img_size``, ``patch_size``, ``depth`` -- blocks, loop steps or
            ODE steps --, ``num_registers``, ``global_pool`` (``"token"`` or ``"avg"``), ``drop_path_rate``,
            ``in_chans``, ``mlp_ratio``, ``embed_dim`` and ``num_heads`` to override the size, and for ``ode``:
            ``solver``, ``scale``, ``norm``, ``rtol``, ``atol``, ``adjoint``); every other keyword is a mixer option
            (``num_atoms``, ``steer``, ``radius``, ...).
        task: ``None``, an image classifier; ``"segmentation"``, the backbone ``name`` with a feature pyramid and a
            segmentation head (``create_segmentation_model``).
        device, dtype: timm's factory keywords: every parameter and buffer is created on ``device`` and cast to the
            floating ``dtype``; neither is part of ``config`` (where a model lives is not what it is).

    Returns:
        The model; ``create_model(**model.config)`` rebuilds it.

    Raises:
        ValueError: unknown name or task, or an option neither the family nor the mixer takes.
    """
    if isinstance(kwargs.get("steer"), list):  # a config read from JSON or YAML: the model records a tuple
        kwargs["steer"] = tuple(kwargs["steer"])
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    if device is not None or dtype is not None:
        return placed(partial(create_model, name, task=task, **kwargs), device, dtype)
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; expected one of {[t for t in TASKS if t]} or none")
        return create_segmentation_model(name, **kwargs)
    family, size, mixer = parse_model_name(name)
    embed_dim, num_heads, depth = SIZES[size]
    own = model_options(family)
    valid_mixer = mixer_options(mixer)
    model_kwargs: dict[str, Any] = {"embed_dim": embed_dim, "num_heads": num_heads, "depth": depth}
    mixer_kwargs: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in own:
            model_kwargs[key] = value
        elif key in valid_mixer:
            mixer_kwargs[key] = value
        else:
            owners = [f for f in FAMILIES if key in model_options(f)]
            where = f"it is an option of the {'/'.join(owners)} family" if owners else "it is not a known option"
            raise ValueError(
                f"{name}: unknown option {key!r} ({where}). Options of the {family} family: {own}; "
                f"options of mixer {mixer!r}: {valid_mixer}"
            )
    return FAMILIES[family](mixer=mixer, mixer_options=mixer_kwargs, name=name, **model_kwargs)


def placed(build: Callable[[], nn.Module], device: Any = None, dtype: Any = None) -> nn.Module:
    """``build()`` with every tensor created on ``device`` (``torch.device`` as a context, so nothing is allocated
    elsewhere first) and the floating parameters and buffers cast to ``dtype``: timm's ``device`` / ``dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = build()
    return model if dtype is None else model.to(dtype=dtype)


def create_segmentation_model(backbone_name: str, *, num_classes: int, pyramid_dim: int = 256, head_dim: int = 128,
                              feature_blocks: list[int] | None = None, **backbone_options: Any) -> SegmentationModel:
    """A semantic segmentation model on the backbone ``backbone_name`` (any family, any registered mixer).

    Args:
        backbone_name: ``"{family}-{size}-{mixer}"`` (``create_model``).
        num_classes: classes of the per-pixel labels.
        pyramid_dim: width of the simple feature pyramid's levels (strides ``p/4 .. 2p``).
        head_dim: width of the semantic-FPN head.
        feature_blocks: ``None``, every pyramid level from the last block (ViTDet); or 4 block indices, finest
            level first, one map per level.
        **backbone_options: ``create_model`` options of the backbone (``img_size``, ``patch_size``, ``depth``, mixer
            options, ...); its ``num_classes`` is 0 (no classifier head).

    Returns:
        The model, logits ``(B, num_classes, H, W)`` at the input's resolution; ``create_model(**model.config)``
        rebuilds it (``config`` holds ``task="segmentation"``).
    """
    backbone = create_model(backbone_name, **{**backbone_options, "num_classes": 0})
    options = dict(num_classes=num_classes, pyramid_dim=pyramid_dim, head_dim=head_dim,
                   feature_blocks=None if feature_blocks is None else list(feature_blocks))
    config = {"name": backbone_name, "task": "segmentation", **given_options(backbone, backbone_options), **options}
    return SegmentationModel(backbone, **options, config=config)


def given_options(backbone: VisionTransformerBase, options: Mapping[str, Any]) -> dict[str, Any]:
    """The backbone options a caller gave, in the form the backbone's ``config`` records them (``img_size`` as
    ``(H, W)``, ``steer`` a tuple): a model that holds a backbone records its config in the one form."""
    return {k: backbone.config.get(k, v) for k, v in options.items()}


def list_models(pattern: str = "*") -> list[str]:
    """Model names matching a shell-style ``pattern`` (e.g. ``"vit-*-ssog*"``), in family, size, mixer order."""
    names = [f"{f}-{s}-{m}" for f in FAMILIES for s in SIZES for m in list_mixers()]
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def check_model_config(config: Any, *, source: str | os.PathLike = "the model config") -> dict[str, Any]:
    """`config` (`create_model(**config)`) if it names a model of ours that builds within the declared ranges and
    `MAX_PARAMETERS`, in the form the model records it (`model.config`); `DocumentError` otherwise. Run on every
    model config read from a file, before building.

    The values are checked by the model's and the mixer's own declarations, building on the meta device (shapes
    only, no memory); so is the parameter count.
    """
    if isinstance(config, Mapping) and "timm_model" in config and "name" not in config:  # convert's timm student
        raise DocumentError(f"{source}: the student of a timm teacher ({config['timm_model']}), an ssogified timm "
                            "model: load it with ssogvit.convert.load_converted (docs/conversion.md)",
                            argument=str(source))
    if not isinstance(config, Mapping) or not isinstance(config.get("name"), str):
        got = f"a dict without a name (keys {', '.join(map(str, list(config)[:5]))})" if isinstance(
            config, Mapping) else type(config).__name__
        raise DocumentError(f"{source}: model_config must be a dict with a 'name', got {got}", argument=str(source))
    config = dict(config)
    check_no_interpolation(config, str(source))
    placement = sorted({"device", "dtype"} & set(config))
    if placement:  # where a model is built is the caller's choice, never a file's
        raise DocumentError(f"{source}: model_config names {placement}, which are not model options",
                            argument=str(source))
    if config["name"] not in list_models():
        raise DocumentError(f"{source}: unknown model {config['name']!r} (see `ssogvit list models`)",
                            argument=str(source))
    try:
        with torch.device("meta"):
            model = create_model(**config)
            n = sum(p.numel() for p in model.parameters())
    except InputError as err:
        raise DocumentError(f"{source}: model_config {err}", argument=str(source)) from None
    except (ValueError, TypeError, RuntimeError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise DocumentError(f"{source}: model_config does not build: {first}", argument=str(source)) from None
    if n > MAX_PARAMETERS:
        raise DocumentError(f"{source}: model_config asks for {n:,} parameters ({format_bytes(4 * n)} in fp32), "
                            f"more than the limit of {MAX_PARAMETERS:,}", argument=str(source))
    return dict(model.config)  # in its one form (`img_size` as (H, W)), whatever form the file wrote


def timm_name(name: str) -> str:
    """timm registry name of a model: ``"vit-small-ssog"`` -> ``"ssogvit_vit_small_ssog"``."""
    parse_model_name(name)
    return "ssogvit_" + name.replace("-", "_")


def from_pretrained(save_directory: str | Path, **kwargs: Any) -> VisionTransformerBase:
    """Load a model written by ``model.save_pretrained(save_directory)`` (Hugging Face hub layout, local folder).

    The same as ``timm.create_model(f"local-dir:{save_directory}", pretrained=True, **kwargs)``: ``config.json`` names
    the architecture and its arguments, ``model.safetensors`` holds the weights. The folder may come from anyone, so
    before anything is built ``config.json`` is read as a bounded document and must name an ssogvit model within its
    declared limits (``check_model_config``), and the weights file must not be larger than that
    model's weights.

    Raises:
        FileNotFoundError: the folder lacks ``config.json`` or ``model.safetensors``.
        ssogvit.documents.DocumentError: ``config.json`` is not an ssogvit model's, or asks for too much.
    """
    folder = Path(save_directory)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder} is not a saved model folder: expected config.json and model.safetensors")
    document = read_document(folder / "config.json", "config.json")
    arch = document.get("architecture") if isinstance(document, dict) else None
    names = {timm_name(n): n for n in list_models()}
    if arch not in names:
        raise DocumentError(f"{folder / 'config.json'}: architecture {arch!r} is not an ssogvit model "
                            "(ssogvit_<family>_<size>_<mixer>); from_pretrained builds only those",
                            argument="config.json")
    _check_saved_folder(folder, names[arch])
    return timm.create_model(f"local-dir:{folder}", pretrained=True, **kwargs)


def _check_saved_folder(folder: Path, name: str) -> dict[str, Any] | None:
    """Refuse a saved folder whose ``model_args`` are not a model ``name`` within limits, or whose weights file is
    larger than that model's weights could be (``DocumentError``); the config sealed in its weights file
    (``sealed_config``, checked against ``config.json``), None without one."""
    document = read_document(folder / "config.json", "config.json")
    args = document.get("model_args", {}) if isinstance(document, dict) else None
    if not isinstance(args, dict):
        raise DocumentError(f"{folder / 'config.json'}: model_args is not a mapping", argument="config.json")
    config = check_model_config({**args, "name": name}, source=folder / "config.json")
    with torch.device("meta"):
        n = sum(p.numel() for p in create_model(**config).parameters())
    weights = folder / "model.safetensors"
    if weights.is_file() and weights.stat().st_size > 8 * n + (1 << 24):  # fp64 at most, and a 16 MB header
        raise DocumentError(f"{weights}: {format_bytes(weights.stat().st_size)}, more than the weights of the model "
                            f"its config.json describes ({n:,} parameters) could be", argument=str(weights))
    top = document.get("num_classes")  # timm builds the head from this one, not from model_args
    if top is not None and top != config.get("num_classes", top):
        raise DocumentError(f"{folder / 'config.json'}: num_classes {top!r} differs from model_args' "
                            f"{config.get('num_classes')!r}; the two must agree", argument="config.json")
    # the sealed config is the one that holds: config.json must state the same model
    return sealed_config(weights) if weights.is_file() else None


SAVED_FOLDER_CHECK.append(_check_saved_folder)  # save_pretrained writes only what this check takes


def _side_copy(file: str | Path) -> tuple[Any, Path] | None:
    """The readable copy of a weights file's config beside it as `(document, path)`, if there is one: an export's
    `model.json`, or the `config.json` of a `save_pretrained` folder."""
    file = Path(file)
    for side in (file.with_suffix(".json"), file.parent / "config.json"):
        if side.is_file() and (side.name != "config.json" or file.name == "model.safetensors"):
            return read_document(side, side.name), side
    return None


def sealed_config(file: str | Path, names: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The config sealed in a weights file (a `.safetensors`, or a `save_pretrained` folder's) with its digest and
    the readable copy beside it (`_side_copy`) checked (`ssogvit.models.sealed`); None for a file that holds no
    config and has no copy beside it (timm's or anyone's). `names`: the timm architectures a saved folder's
    `config.json` may name, mapped to the config's `name` (default: ssogvit's models)."""
    from safetensors.torch import load_file

    file = weights_path(file)
    side = _side_copy(file)
    with safe_open(str(file), framework="pt") as f:
        header = dict(f.metadata() or {})
    if header_config(header, file) is None and side is None:
        return None
    verify(load_file(str(file)), header, file)
    return file_config(file, header, side, {timm_name(n): n for n in list_models()} if names is None else names)


def weights_path(path: str | Path) -> Path:
    """``path``, or for a ``save_pretrained`` folder (``config.json`` and ``model.safetensors``) its
    ``model.safetensors``: every command and loader that takes a weights file takes such a folder too."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "model.safetensors").is_file() and (p / "config.json").is_file():
        return p / "model.safetensors"
    return p


def _weights_file(file: str | Path) -> Path:
    """``weights_path(file)``, which must be a file (``FileNotFoundError`` naming it)."""
    path = weights_path(file)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file {path}" + (" (a folder that is not a save_pretrained folder)"
                                                             if path.is_dir() else ""))
    return path


def read_weights(file: str | Path) -> tuple[dict[str, Tensor], dict | None]:
    """The tensors of a weights file and the ssogvit model config it holds (``None`` for a file of timm's or
    anyone's): a sealed ``.safetensors`` (export, ``save_pretrained``; its digest and the readable copy beside it
    checked), or a state dict saved by
    ``torch.save`` / safetensors (timm's loader, weights only)."""
    from safetensors.torch import load_file
    from timm.models import load_state_dict

    path = _weights_file(file)
    if path.suffix == ".safetensors":
        config = sealed_config(path)
        return load_file(str(path)), config
    return load_state_dict(str(path), weights_only=True), None


def load_weights(module: nn.Module, file: str | Path) -> nn.Module:
    """Load a weights file (``read_weights``) into the ssogvit model inside ``module`` (``target_model``: an smp
    network, timm's ``features_only`` wrapper, a ``PyramidViT`` or a classifier), renamed by ``carry_state_dict``
    and loaded strictly. A file that holds another model's config is refused naming both. Returns ``module``."""
    model = target_model(module)
    state, config = read_weights(file)
    backbone = getattr(model, "backbone", model)
    name = backbone.config.get("name") if hasattr(backbone, "config") else None
    if config is not None and config.get("name") != name:
        raise ValueError(f"{file} holds weights of {config.get('name')!r}, not of {name!r}")
    try:
        model.load_state_dict(carry_state_dict(state, model), strict=True)
    except RuntimeError as err:
        lines = str(err).splitlines()
        first = lines[1].strip() if len(lines) > 1 else err
        raise ValueError(f"{file} does not fit the {name} model built here ({first}"
                         "): build it with the options the weights were trained with, or let timm build it from the "
                         "file (pretrained=True, pretrained_cfg_overlay=dict(file=...))") from None
    return module


#: options of a segmentation export that are its pyramid's (kept by a pyramid model) or its head's (dropped)
_PYRAMID_OPTIONS, _SEGMENTATION_HEAD = ("pyramid_dim", "feature_blocks"), ("task", "num_classes", "head_dim")
#: keywords of a build from a weights file (``pretrained_cfg_overlay=dict(file=...)``, ``local-dir:``) that may differ
#: from the file's config: what the carried weights do not fix (``carry_state_dict``: a new head for another class
#: count, the position embedding resized to another image size; regularisation, the pool, padding). Any other
#: keyword that differs is refused before anything is built.
FILE_MAY_DIFFER = ("num_classes", "img_size", "drop_path_rate", "global_pool", "dynamic_img_pad")


def _as_file_builds(kwargs: dict[str, Any], saved: Mapping[str, Any], keys: list[str], file: Any) -> None:
    """``kwargs`` completed with the file's config ``saved`` (its ``keys``); a keyword that contradicts the file
    (``FILE_MAY_DIFFER`` aside) is an ``InputError`` naming it, the value given and the file's."""
    built = dict(saved)  # a mixer option the file does not record was built at the mixer's default
    if isinstance(saved.get("name"), str):
        built = {**mixer_option_defaults(parse_model_name(saved["name"])[2]), **built}
    for key in [*keys, *(k for k in kwargs if k in built and k not in saved)]:
        given = kwargs.get(key, built[key])
        if key not in FILE_MAY_DIFFER and json.dumps(given, default=str) != json.dumps(built[key], default=str):
            raise InputError(f"{key}={given!r} contradicts {file}, whose weights were built with {key}="
                             f"{built[key]!r}: leave {key} out (the file's value is used) or load weights built "
                             f"with {key}={given!r}", argument=key)
        if key in saved:
            kwargs.setdefault(key, saved[key])


def _pretrained_cfg(tname: str, name: str, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """timm's pretrained config of a ``pretrained=True`` build (``pretrained_cfg_overlay=dict(file=...)``, a
    ``local-dir:`` folder) and the ssogvit config the weights file holds (``None`` for a file of timm's or anyone's,
    e.g. a timm ViT's state dict); a file that holds another model's weights is refused naming both."""
    cfg = resolve_pretrained_cfg(tname, pretrained_cfg=kwargs.pop("pretrained_cfg", None),
                                 pretrained_cfg_overlay=kwargs.pop("pretrained_cfg_overlay", None))
    if not (cfg.file or cfg.url or cfg.hf_hub_id or cfg.state_dict):
        raise ValueError(f"{tname}: ssogvit has no pretrained weights to download; load your own with "
                         "pretrained_cfg_overlay=dict(file='.../model.safetensors')")
    if cfg.source == "local-dir" and cfg.file:  # a saved folder: its config.json came from disk
        _check_saved_folder(Path(cfg.file), name)
    saved, sealed_checked = None, False
    if cfg.file and cfg.source != "local-dir":  # a file overlay: a save_pretrained folder stands for its weights
        file = _weights_file(cfg.file)
        if file != Path(cfg.file).expanduser():  # the folder's checks verify the seal once
            saved, sealed_checked = _check_saved_folder(file.parent, name), True
        cfg = replace(cfg, file=str(file))
    if not sealed_checked and cfg.file and str(cfg.file).endswith(".safetensors"):
        saved = sealed_config(cfg.file)
    if saved is not None and saved.get("name") != name:
        raise ValueError(f"{cfg.file} holds weights of {saved.get('name')!r}, not of {name!r}")
    return cfg, saved


def _refuse_unused_file(pretrained: bool, kwargs: Mapping[str, Any]) -> None:
    """timm builds a model with random weights when ``pretrained_cfg_overlay`` names a weights file but ``pretrained``
    is not set, and ignores the file without a word: refused here, naming the fix."""
    overlay = kwargs.get("pretrained_cfg_overlay")
    if not pretrained and isinstance(overlay, Mapping) and overlay.get("file"):
        raise InputError(f"pretrained_cfg_overlay=dict(file={str(overlay['file'])!r}) without pretrained=True: timm "
                         "would build the model with random weights and ignore the file; pass pretrained=True (smp: "
                         "encoder_weights=True) to load it, or leave the file out", argument="pretrained")


def _given_cfg(tname: str, kwargs: dict[str, Any]) -> Any:
    """The pretrained config resolved already (``_pretrained_cfg``), or the name's default with the caller's overlay."""
    cfg = kwargs.pop("pretrained_cfg", None)
    if isinstance(cfg, PretrainedCfg):
        return cfg
    overlay = kwargs.pop("pretrained_cfg_overlay", None)
    return resolve_pretrained_cfg(tname, pretrained_cfg=cfg, pretrained_cfg_overlay=overlay)


def _input_cfg(cfg: Any, kwargs: Mapping[str, Any], reduction: float | None = None) -> Any:
    """``cfg`` describing the model built with ``kwargs``: its input size and channels (and, for a pyramid, the grid
    of ``forward_features``), so ``timm.data.resolve_model_data_config`` and timm's tests read the model as built."""
    img = kwargs.get("img_size", 224)
    img = (img, img) if isinstance(img, int) else tuple(img)
    cfg = replace(cfg, input_size=(kwargs.get("in_chans", cfg.input_size[0]), *img))
    if reduction is not None:
        cfg = replace(cfg, pool_size=tuple(-(-side // int(reduction)) for side in img))
    return cfg


def _timm_entrypoint(name: str):
    tname = timm_name(name)

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        _refuse_unused_file(pretrained, kwargs)
        placement = {k: kwargs.pop(k) for k in ("device", "dtype") if k in kwargs}
        if pretrained:
            cfg, saved = _pretrained_cfg(tname, name, kwargs)
            if saved is not None:  # an ssogvit export: the weights say how the backbone was built
                segmentation = saved.get("task") == "segmentation"  # its backbone only: a classifier is built here
                _as_file_builds(kwargs, saved, [k for k in saved if k not in (
                    "name", *_PYRAMID_OPTIONS, *_SEGMENTATION_HEAD) or (k == "num_classes" and not segmentation)],
                    cfg.file)
                if not segmentation:
                    cfg = replace(cfg, num_classes=saved.get("num_classes", cfg.num_classes))
            kwargs["pretrained_cfg"] = cfg
        kwargs["pretrained_cfg"] = _input_cfg(_given_cfg(tname, kwargs), kwargs)
        return build_model_with_cfg(
            partial(create_model, name, **placement), tname, pretrained, feature_cfg=dict(feature_cls="getter"),
            pretrained_filter_fn=carry_state_dict, **kwargs
        )

    entrypoint.__name__ = entrypoint.__qualname__ = tname
    entrypoint.__doc__ = f"``{name}`` from ssogvit (``ssogvit.create_model({name!r}, **kwargs)``)."
    return entrypoint


#: timm's default pretrained configs of the registered names (no weights: ``file`` / ``url`` come as an overlay)
_DEFAULT_CFG = dict(input_size=(3, 224, 224), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, num_classes=1000,
                    fixed_input_size=False, interpolation="bicubic", crop_pct=1.0, license="apache-2.0")
default_cfgs = generate_default_cfgs({
    **{timm_name(n): dict(_DEFAULT_CFG, first_conv="patch_embed.proj", classifier="head") for n in list_models()},
    **{timm_name(n) + "_pyramid": dict(_DEFAULT_CFG, first_conv="backbone.patch_embed.proj", classifier="head.fc",
                                       pool_size=(7, 7)) for n in list_models()},
})


def _pyramid_entrypoint(name: str):
    """timm entry point ``ssogvit_<family>_<size>_<mixer>_pyramid``: a ``PyramidViT`` (backbone, simple feature
    pyramid, a classifier on it); ``features_only=True`` gives the levels, what segmentation_models_pytorch's ``tu-``
    encoders build; ``output_stride`` caps their reductions (``pyramid_scales``)."""
    tname = timm_name(name) + "_pyramid"

    def entrypoint(pretrained: bool = False, *, pyramid_dim: int = 256, feature_blocks: list[int] | None = None,
                   output_stride: int | None = None, global_pool: str = "avg", drop_rate: float = 0.0,
                   **kwargs: Any) -> nn.Module:
        _refuse_unused_file(pretrained, kwargs)
        placement = {k: kwargs.pop(k) for k in ("device", "dtype") if k in kwargs}
        pyramid = dict(pyramid_dim=pyramid_dim, feature_blocks=feature_blocks)
        if pretrained:
            cfg, saved = _pretrained_cfg(tname, name, kwargs)
            if saved is not None:  # the backbone (and a segmentation model's pyramid) as the weights were built
                pyramid.update({k: saved[k] for k in _PYRAMID_OPTIONS if k in saved})
                _as_file_builds(kwargs, saved, [k for k in saved if k not in (
                    "name", *_PYRAMID_OPTIONS, *_SEGMENTATION_HEAD)], cfg.file)
            kwargs["pretrained_cfg"] = cfg
        kwargs.pop("global_pool", None)
        patch = kwargs.get("patch_size", 16)
        check_pyramid_patch(patch)  # before timm's own checks of the reductions, which fail with an empty message
        kwargs["pretrained_cfg"] = _input_cfg(_given_cfg(tname, kwargs), kwargs,
                                              patch / min(pyramid_scales(patch, output_stride)))
        if pretrained:
            kwargs["pretrained_cfg"] = replace(kwargs["pretrained_cfg"], num_classes=kwargs.get("num_classes", 1000))

        def build(num_classes: int = 1000, **backbone_options: Any) -> PyramidViT:
            backbone = create_model(name, **{**backbone_options, "num_classes": 0})
            config = {"name": name, **given_options(backbone, backbone_options), **pyramid,
                      "output_stride": output_stride, "num_classes": num_classes}
            return PyramidViT(backbone, num_classes=num_classes, global_pool=global_pool, drop_rate=drop_rate,
                              output_stride=output_stride, config=config, **pyramid)

        def build_placed(**options: Any) -> nn.Module:
            return placed(partial(build, **options), **placement)

        return build_model_with_cfg(
            build_placed, tname, pretrained,
            feature_cfg=dict(feature_cls="getter", out_indices=tuple(range(NUM_LEVELS))),
            pretrained_filter_fn=carry_state_dict, **kwargs
        )

    entrypoint.__name__ = entrypoint.__qualname__ = tname
    entrypoint.__doc__ = (f"``{name}`` with ViTDet's simple feature pyramid and a classifier on it (``PyramidViT``); "
                          "``features_only=True`` gives the levels, strides p/4 to 2p.")
    return entrypoint


def _register_with_timm() -> None:
    module = sys.modules[__name__]
    for name in list_models():
        for fn in (_timm_entrypoint(name), _pyramid_entrypoint(name)):
            setattr(module, fn.__name__, fn)  # timm lists the entry point in this module's __all__
            register_model(fn)


_register_with_timm()
