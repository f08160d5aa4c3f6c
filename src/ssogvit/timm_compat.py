"""Put SSoG into a timm ``VisionTransformer`` that is already built (or pretrained).

    model = timm.create_model("vit_small_patch16_224", num_classes=100, dynamic_img_size=True)
    ssogvit.ssogify(model)                       # fixed SSoG, V and output projections carried over
    ssogvit.ssogify(model, mixer="ssog-steered")  # or content-steered

Every ``block.attn`` becomes an ``SSoGAttention`` (a subclass that accepts timm's call). The value rows of the old
``qkv`` projection and the output projection ``proj`` are copied over; queries and keys are dropped. The patch grid of
each forward pass is read off the patch embedding by a forward hook and kept with each block's input (timm calls its
blocks ``blk(x)``), so ``dynamic_img_size=True``, register tokens, models without a class token, gradient
checkpointing over forwards at different grids and ``copy.deepcopy`` (EMA) all work. The fields are in the model's
``no_weight_decay()`` (timm's ``create_optimizer_v2`` reads it), and ``model.save_pretrained(folder)`` writes what
``timm.create_model(f"local-dir:{folder}", pretrained=True)`` rebuilds.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import timm
import torch
from timm.layers import Attention as TimmAttention
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from ssogvit.specs import Choice, Flag, check_images, checked
from ssogvit.layers.attention import Attention
from ssogvit.layers.ssog import STEER_PATHS, SSoGAttention, is_ssog

__all__ = ["SSOGIFIED", "ssogify", "save_pretrained", "TimmSSoGAttention", "unique_blocks"]

#: attention classes whose whole forward is known: qkv -> (q/k norms) -> softmax attention -> proj -> dropout
_CARRIED_CLASSES = (TimmAttention, Attention)


class _GridTracker:
    """The patch grid of each forward pass of an ssogified timm model, for its mixers (timm calls a block ``blk(x)``).

    A forward hook on timm's ``PatchEmbed`` records the grid of the latest call (``grid``). A forward pre-hook on
    every block takes, for the block's input tensor, the grid of the forward pass that tensor belongs to: the latest
    grid the first time the block sees it, the grid remembered with it when the block runs on it again. Gradient
    checkpointing runs a block again on its saved input in the backward pass, possibly after another forward at
    another grid (multi-crop training), and so gets that input's own grid back (``block_grid``, while the block
    runs). The inputs are held weakly, so nothing outlives its tensor.
    """

    def __init__(self) -> None:
        self.grid: tuple[int, int] | None = None
        self.block_grid: tuple[int, int] | None = None
        self._inputs = WeakTensorKeyDictionary()

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if output.ndim == 4:
            fmt = str(getattr(module, "output_fmt", "NHWC"))
            self.grid = tuple(output.shape[2:4]) if fmt.endswith("NCHW") else tuple(output.shape[1:3])
        else:
            size = tuple(args[0].shape[-2:])
            if hasattr(module, "dynamic_feat_size"):
                self.grid = tuple(module.dynamic_feat_size(size))
            else:
                ph, pw = module.patch_size
                self.grid = (size[0] // ph, size[1] // pw)

    def enter_block(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of a block: the grid of the forward pass its input belongs to."""
        x = args[0] if args else None
        if not isinstance(x, Tensor) or torch.compiler.is_compiling():  # a graph has no backward recomputation
            self.block_grid = self.grid
            return
        grid = self._inputs.get(x)
        if grid is None:  # reentrant checkpointing recomputes on a detached alias of the saved input
            key = (x.data_ptr(), x.shape, x.stride())
            grid = next((g for t, g in self._inputs.items() if (t.data_ptr(), t.shape, t.stride()) == key), None)
        if grid is None:
            grid = self._inputs[x] = self.grid
        self.block_grid = grid

    def leave_block(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.block_grid = None

    def __deepcopy__(self, memo: dict) -> _GridTracker:  # a copy (EMA) tracks its own forwards
        twin = _GridTracker()
        twin.grid = self.grid
        return twin

    def __getstate__(self) -> dict[str, Any]:
        return {"grid": self.grid}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.grid = state["grid"]


class TimmSSoGAttention(SSoGAttention):
    """``SSoGAttention`` with timm's attention call ``attn(x, attn_mask=None, is_causal=False)``.

    The grid comes from the forward pass the block's input belongs to (``_GridTracker``, set up by ``ssogify``)
    unless passed explicitly; the number of prefix tokens is the model's, so a token count that does not fit the grid
    is an error.
    """

    def __init__(
        self, dim: int, num_heads: int, *, grid_tracker: _GridTracker, num_prefix_tokens: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, **options)
        self._grid_tracker = grid_tracker
        self.num_prefix_tokens = num_prefix_tokens

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        grid: tuple[int, int] | None = None,
        num_prefix_tokens: int | None = None,
    ) -> Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("SSoG mixes by relative grid position and takes no attention mask or causal flag")
        prefix = self.num_prefix_tokens if num_prefix_tokens is None else num_prefix_tokens
        return super().forward(x, self._grid(grid), num_prefix_tokens=prefix)

    def attention_matrix(  # type: ignore[override]
        self, x: Tensor, grid: tuple[int, int] | None = None, *, num_prefix_tokens: int | None = None
    ) -> Tensor:
        prefix = self.num_prefix_tokens if num_prefix_tokens is None else num_prefix_tokens
        return super().attention_matrix(x, self._grid(grid), num_prefix_tokens=prefix)

    def _grid(self, grid: tuple[int, int] | None) -> tuple[int, int]:
        tracker = self._grid_tracker
        grid = grid if grid is not None else tracker.block_grid if tracker.block_grid is not None else tracker.grid
        if grid is None:
            raise ValueError("no patch grid recorded yet: run the timm model's forward (or pass grid=(Gh, Gw))")
        return grid


def _named(module: nn.Module) -> set[str]:
    """Lower-case names of a module's own attributes, parameters, buffers and submodules (all depths)."""
    names = {n.lower() for n in vars(module)}
    for kind in (module.named_parameters(), module.named_buffers(), module.named_modules()):
        names |= {part.lower() for n, _ in kind for part in n.split(".") if part}
    return names


def _has(module: nn.Module, *fragments: str) -> bool:
    return any(f in n for n in _named(module) for f in fragments)


def _cannot_carry(attn: nn.Module) -> list[str]:
    """What an attention module computes that SSoG plus the carried ``v`` and ``proj`` would not (empty: faithful)."""
    forward_args = set(inspect.signature(type(attn).forward).parameters)
    problems = []
    if "rope" in forward_args or _has(attn, "rope", "rotary"):
        problems.append("rotary position embedding (rope)")
    if forward_args & {"rel_pos_bias", "shared_rel_pos", "shared_rel_pos_bias"} or _has(
        attn, "rel_pos", "relative_position"
    ):
        problems.append("relative position bias")
    if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
        problems.append("a norm inside the attention, before the output projection")
    if getattr(attn, "q_bias", None) is not None or getattr(attn, "v_bias", None) is not None:
        problems.append("separate q/v biases outside the qkv projection")
    if getattr(attn, "gate", None) is not None:
        problems.append("an output gate")
    if float(getattr(getattr(attn, "attn_drop", None), "p", 0.0)) > 0:
        problems.append("attention dropout (attn_drop_rate > 0): SSoG has no attention probabilities to drop; build "
                        "the timm model with attn_drop_rate=0")
    qkv, proj = getattr(attn, "qkv", None), getattr(attn, "proj", None)
    if not isinstance(qkv, nn.Linear) or not isinstance(proj, nn.Linear):
        problems.append("no fused qkv and proj linear layers")
    elif qkv.out_features != 3 * qkv.in_features or proj.in_features != qkv.in_features or proj.out_features != (
        qkv.in_features
    ):
        d = qkv.in_features
        problems.append(
            f"projection shapes other than qkv {d}->{3 * d}, proj {d}->{d} (got qkv {qkv.in_features}->"
            f"{qkv.out_features}, proj {proj.in_features}->{proj.out_features})"
        )
    if not problems and type(attn) not in _CARRIED_CLASSES:
        problems.append("an attention class ssogify does not know, so it cannot check what its forward computes")
    return problems


def _model_cannot_carry(model: nn.Module) -> list[str]:
    problems = []
    patch_drop = getattr(model, "patch_drop", None)
    if patch_drop is not None and not isinstance(patch_drop, nn.Identity) and getattr(patch_drop, "prob", 1.0) > 0:
        problems.append("patch dropout (patch_drop_rate > 0): dropped patches leave no grid to mix over")
    if getattr(model, "rope", None) is not None:
        problems.append("rotary position embedding (rope)")
    if getattr(model, "rel_pos_bias", None) is not None or getattr(model, "rel_pos", None) is not None:
        problems.append("relative position bias")
    return problems


def unique_blocks(model: nn.Module) -> list[nn.Module]:
    """The distinct block modules of ``model.blocks``, in order. A looped or ODE model of ours presents its one shared
    block (``model.blocks.block``) as ``depth`` applications; each block must be converted (or hooked) once."""
    shared = getattr(model.blocks, "block", None)
    blocks = [shared] if isinstance(shared, nn.Module) else list(model.blocks)
    return list({id(b): b for b in blocks}.values())


@checked
def ssogify(model: nn.Module, *, mixer: Annotated[str, Choice(("ssog", "ssog-steered"))] = "ssog",
            copy_weights: Annotated[bool, Flag()] = True, **options: Any) -> nn.Module:
    """Replace the attention of every block of a timm ``VisionTransformer`` by SSoG, in place.

    Only what SSoG can carry faithfully is accepted: timm's plain ``Attention`` (or ssogvit's MHA) with fused ``qkv``
    and ``proj`` linears. The value rows of ``qkv`` and the output projection, biases included (each exactly as the
    old layer had it, ``qkv_bias=False`` too), and the output dropout are carried over; queries and keys, and the
    q/k norms that act on them, are dropped. Anything else that the attention or the model computes and SSoG could
    not reproduce (rotary or relative position terms, a norm inside the attention, separate q/v biases, an output
    gate, patch dropout, blocks without an ``attn``) is refused with a ``ValueError`` naming the block, the class and
    what cannot be carried, before anything is changed.

    Args:
        model: a built timm ``VisionTransformer`` (``patch_embed`` and ``blocks[i].attn``).
        mixer: ``"ssog"`` (fixed field) or ``"ssog-steered"`` (all three paths unless ``steer`` is given).
        copy_weights: carry the value part of ``qkv`` and the output projection over from the old attention.
        **options: ``SSoGAttention`` options (``num_atoms``, ``steer``, ``radius``, ``sigma_min``, ...).

    Returns:
        The same model, for chaining.
    """
    if mixer == "ssog-steered":
        options.setdefault("steer", STEER_PATHS)
    elif options.get("steer"):
        raise ValueError("mixer 'ssog' is the fixed field; use mixer='ssog-steered' to steer")
    for carried in ("bias", "proj_bias", "proj_drop"):
        if carried in options:
            raise ValueError(f"ssogify carries {carried!r} over from each attention layer; do not pass it")
    if not hasattr(model, "patch_embed") or not hasattr(model, "blocks"):
        raise ValueError("ssogify expects a timm VisionTransformer (with .patch_embed and .blocks)")
    problems = [f"the model: {p}" for p in _model_cannot_carry(model)]
    for i, block in enumerate(unique_blocks(model)):
        old = getattr(block, "attn", None)
        if old is None:
            problems.append(f"block {i} ({type(block).__name__}): no .attn to replace")
        else:
            problems += [f"block {i} ({type(old).__name__}): {p}" for p in _cannot_carry(old)]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ValueError(f"ssogify cannot reproduce this {type(model).__name__} faithfully: {shown}")
    tracker = _GridTracker()
    model.register_forward_pre_hook(_check_images)  # timm's reshapes would fail on a batch of 0 with their own words
    model.patch_embed.register_forward_hook(tracker)
    prefix = getattr(model, "num_prefix_tokens", None)
    for block in unique_blocks(model):
        block.register_forward_pre_hook(tracker.enter_block)
        block.register_forward_hook(tracker.leave_block)
        old = block.attn
        dim = old.qkv.in_features
        new = TimmSSoGAttention(
            dim, old.num_heads, grid_tracker=tracker, num_prefix_tokens=prefix, bias=old.qkv.bias is not None,
            proj_bias=old.proj.bias is not None, proj_drop=float(getattr(old.proj_drop, "p", 0.0)), **options
        ).to(device=old.qkv.weight.device, dtype=old.qkv.weight.dtype)
        if copy_weights:
            with torch.no_grad():
                new.v.weight.copy_(old.qkv.weight[2 * dim :])
                new.proj.weight.copy_(old.proj.weight)
                if old.qkv.bias is not None:
                    new.v.bias.copy_(old.qkv.bias[2 * dim :])
                if old.proj.bias is not None:
                    new.proj.bias.copy_(old.proj.bias)
        block.attn = new
    model.ssogify_options = {"mixer": mixer, **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}
    # what timm's optimizer factory and hub writer call on a model: instance attributes, so the model's class is kept
    model.no_weight_decay = partial(_no_weight_decay, model, getattr(model, "no_weight_decay", None))
    model.save_pretrained = partial(save_pretrained, model)
    return model


def _check_images(model: nn.Module, args: tuple[Any, ...]) -> None:
    """The forward pre-hook ``ssogify`` gives the model: its images checked as ssogvit's own models check theirs."""
    if args:
        check_images(args[0])


def _no_weight_decay(model: nn.Module, inherited: Callable[[], set[str]] | None) -> set[str]:
    """The model's own no-decay names (timm's: position embedding and tokens) and every SSoG field by full name
    (``SSoGAttention.no_weight_decay``), as ssogvit's own models exclude them."""
    names = set(inherited() if inherited is not None else ())
    for prefix, module in model.named_modules():
        if is_ssog(module):
            names |= {f"{prefix}.{name}" for name in module.no_weight_decay()}
    return names


#: timm architecture of an ssogified model saved by ``save_pretrained``: the base architecture, then ``ssogify``
SSOGIFIED = "ssogvit_ssogified"


def save_pretrained(model: nn.Module, save_directory: str | Path, *, overwrite: bool = True) -> Path:
    """Write an ssogified model in the Hugging Face hub layout (timm's ``save_for_hf``), so that
    ``timm.create_model(f"local-dir:{save_directory}", pretrained=True)`` rebuilds it bit for bit.

    ``config.json`` names the architecture ``ssogvit_ssogified`` with the base architecture and its arguments (as
    timm's factory recorded them, or an ssogvit model's ``config``) and the options ``ssogify`` was called with;
    ``model.safetensors`` holds the weights. ``ssogify`` makes this the model's ``save_pretrained``. A second save
    into the same folder replaces it atomically, as timm's does (``VisionTransformerBase.save_pretrained``).

    Raises:
        FileExistsError: the folder is a file, a link or holds other files, or a saved model while ``overwrite`` is
            ``False``.
        ValueError: ``model`` was not made by ``ssogify``.
    """
    from ssogvit.models import VisionTransformerBase, timm_name

    options = getattr(model, "ssogify_options", None)
    if options is None:
        raise ValueError("save_pretrained here saves a model made by ssogify(); ssogvit's own models have their own")
    from ssogvit.models._common import write_saved_folder

    if isinstance(model, VisionTransformerBase):  # a model of ours: its config rebuilds it
        base, base_args = timm_name(model.config["name"]), {k: v for k, v in model.config.items() if k != "name"}
    else:  # timm's factory recorded the arguments (``_model_args``); for a reloaded model, also the base
        recorded = getattr(model, "_model_args", {})
        base, base_args = recorded.get("ssogify_base", model.pretrained_cfg["architecture"]), {}
    args = {**base_args, "ssogify_base": base, "ssogify_options": options}
    return write_saved_folder(save_directory, model, model_args=args,
                              model_config={"pretrained_cfg": {"architecture": SSOGIFIED}}, overwrite=overwrite)


def _ssogified_entrypoint(
    pretrained: bool = False, *, ssogify_base: str, ssogify_options: dict[str, Any], **kwargs: Any
) -> nn.Module:
    """timm entry point ``ssogvit_ssogified``: ``ssogify_base`` built with the other arguments, then ``ssogify``'d
    with ``ssogify_options`` (the mixer and its options); with ``pretrained``, the saved weights loaded."""
    options = dict(ssogify_options)
    mixer = options.pop("mixer")
    if pretrained:  # the weights file sealed by save_pretrained: its digest and config.json checked before a build
        from timm.models import resolve_pretrained_cfg

        from ssogvit.models.registry import sealed_config

        cfg = resolve_pretrained_cfg(SSOGIFIED, pretrained_cfg=kwargs.pop("pretrained_cfg", None),
                                     pretrained_cfg_overlay=kwargs.pop("pretrained_cfg_overlay", None))
        if cfg.file:
            sealed_config(cfg.file, {SSOGIFIED: SSOGIFIED})
        kwargs["pretrained_cfg"] = cfg

    def build(**base_args: Any) -> nn.Module:
        return ssogify(timm.create_model(ssogify_base, **base_args), mixer=mixer, copy_weights=False, **options)

    return build_model_with_cfg(build, SSOGIFIED, pretrained, **kwargs)


_ssogified_entrypoint.__name__ = _ssogified_entrypoint.__qualname__ = SSOGIFIED
default_cfgs = generate_default_cfgs({SSOGIFIED: dict(num_classes=1000, input_size=(3, 224, 224))})
register_model(_ssogified_entrypoint)
