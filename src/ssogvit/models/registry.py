"""``create_model`` / ``list_models``: every family x size x mixer by name, also registered with timm.

Names are ``"{family}-{size}-{mixer}"``, e.g. ``"vit-small-ssog"``, ``"looped-base-mha"``, ``"ode-base-ssog-steered"``.
In timm the same models are ``"ssogvit_{family}_{size}_{mixer}"`` with ``-`` written ``_``
(``timm.create_model("ssogvit_vit_small_ssog", num_classes=100)``) once ``ssogvit.models`` is imported.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import timm
from safetensors import safe_open
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model, resolve_pretrained_cfg
from torch import nn

from ssogvit.layers import list_mixers, mixer_options

from ._common import SIZES, VisionTransformerBase
from .looped import LoopedViT
from .ode import ODEViT
from .vit import VisionTransformer

__all__ = [
    "FAMILIES", "SIZES", "create_model", "from_pretrained", "list_models", "model_options", "parse_model_name",
    "timm_name",
]

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


def create_model(name: str, **kwargs: Any) -> VisionTransformerBase:
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

    Returns:
        The model; ``create_model(**model.config)`` rebuilds it.

    Raises:
        ValueError: unknown name, or an option neither the family nor the mixer takes.
    """
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


def list_models(pattern: str = "*") -> list[str]:
    """Model names matching a shell-style ``pattern`` (e.g. ``"vit-*-ssog*"``), in family, size, mixer order."""
    names = [f"{f}-{s}-{m}" for f in FAMILIES for s in SIZES for m in list_mixers()]
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def timm_name(name: str) -> str:
    """timm registry name of a model: ``"vit-small-ssog"`` -> ``"ssogvit_vit_small_ssog"``."""
    parse_model_name(name)
    return "ssogvit_" + name.replace("-", "_")


def from_pretrained(save_directory: str | Path, **kwargs: Any) -> VisionTransformerBase:
    """Load a model written by ``model.save_pretrained(save_directory)`` (Hugging Face hub layout, local folder).

    The same as ``timm.create_model(f"local-dir:{save_directory}", pretrained=True, **kwargs)``: ``config.json`` names
    the architecture and its arguments, ``model.safetensors`` holds the weights.
    """
    folder = Path(save_directory)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder} is not a saved model folder: expected config.json and model.safetensors")
    return timm.create_model(f"local-dir:{folder}", pretrained=True, **kwargs)


def _saved_config(file: str) -> dict[str, Any] | None:
    """The model config in the header of an ``ssogvit`` safetensors export, if the file is one."""
    if not str(file).endswith(".safetensors"):
        return None
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta["model_config"]) if "model_config" in meta else None


def _timm_entrypoint(name: str):
    tname = timm_name(name)

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        if pretrained:
            cfg = resolve_pretrained_cfg(
                tname, pretrained_cfg=kwargs.pop("pretrained_cfg", None),
                pretrained_cfg_overlay=kwargs.pop("pretrained_cfg_overlay", None),
            )
            if not (cfg.file or cfg.url or cfg.hf_hub_id or cfg.state_dict):
                raise ValueError(
                    f"{tname}: ssogvit has no pretrained weights to download; load your own with "
                    "pretrained_cfg_overlay=dict(file='.../model.safetensors')"
                )
            saved = _saved_config(cfg.file) if cfg.file else None
            if saved is not None:  # an ssogvit export: the weights say how the model was built
                if saved.get("name") != name:
                    raise ValueError(f"{cfg.file} holds weights of {saved.get('name')!r}, not of {name!r}")
                for key, value in saved.items():
                    if key != "name":
                        kwargs.setdefault(key, value)
                img = saved.get("img_size", 224)
                img = (img, img) if isinstance(img, int) else tuple(img)
                cfg = replace(cfg, num_classes=saved["num_classes"], input_size=(saved.get("in_chans", 3), *img))
            kwargs["pretrained_cfg"] = cfg
        return build_model_with_cfg(
            partial(create_model, name), tname, pretrained, feature_cfg=dict(feature_cls="getter"), **kwargs
        )

    entrypoint.__name__ = entrypoint.__qualname__ = tname
    entrypoint.__doc__ = f"``{name}`` from ssogvit (``ssogvit.create_model({name!r}, **kwargs)``)."
    return entrypoint


#: timm's default pretrained configs of the registered names (no weights: ``file`` / ``url`` come as an overlay)
default_cfgs = generate_default_cfgs({
    timm_name(n): dict(
        input_size=(3, 224, 224), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, num_classes=1000,
        first_conv="patch_embed.proj", classifier="head", fixed_input_size=False, interpolation="bicubic",
        crop_pct=1.0, license="apache-2.0",
    )
    for n in list_models()
})


def _register_with_timm() -> None:
    module = sys.modules[__name__]
    for name in list_models():
        fn = _timm_entrypoint(name)
        setattr(module, fn.__name__, fn)  # timm lists the entry point in this module's __all__
        register_model(fn)


_register_with_timm()
