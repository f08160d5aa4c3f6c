"""Pieces every model family shares (docs/models.md): patch embedding, class / register tokens, absolute position
embedding, the pre-norm block, the final norm and the linear head.

Every family is timm's ``VisionTransformer`` and differs only in its ``blocks`` (how the block is applied); the mixer
inside a block is chosen by name from the mixer registry, so an SSoG model and its baseline differ only in that name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, to_2tuple, trunc_normal_
from timm.models import checkpoint, save_for_hf
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import Tensor, nn

from ssogvit.errors import InputError
from ssogvit.resources import check_memory
from ssogvit.specs import (
    DEPTH,
    DROP_RATE,
    EMBED_DIM,
    GRID_RATIO,
    IMG_SIZE,
    IN_CHANS,
    MLP_RATIO,
    NUM_CLASSES,
    NUM_HEADS,
    NUM_REGISTERS,
    PATCH_SIZE,
    AppliesOnly,
    Choice,
    Flag,
    IntOrPair,
    check_applies,
    check_images,
    checked,
)
from ssogvit.layers import create_mixer, default_pool, is_ssog
from ssogvit.outputs import replace_folder

from . import transfer
from .sealed import seal_file

__all__ = ["GLOBAL_POOLS", "SIZES", "Block", "BlockStack", "CenterNorm", "VisionTransformerBase", "layer_norm"]

#: size name -> (embed_dim, num_heads, depth). Depth is blocks (vit), loop steps T (looped) or steps / NFE (ode).
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 3, 12),
    "small": (384, 6, 12),
    "medium": (576, 9, 12),
    "base": (768, 12, 12),
    "large": (1024, 16, 24),
}

LN_EPS = 1e-6

#: what the head reads: ``"token"`` the class token, ``"avg"`` the mean of the patch tokens (class and registers out)
GLOBAL_POOLS: tuple[str, ...] = ("token", "avg")


def layer_norm(dim: int) -> nn.LayerNorm:
    """timm ViT's LayerNorm (``eps = 1e-6``)."""
    return nn.LayerNorm(dim, eps=LN_EPS)


class CenterNorm(nn.Module):
    """CenterNorm (ODE-ViT): ``(D / (D - 1)) * (z - mean(z)) * gamma + beta``, centring without rescaling by the std."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim < 2:
            raise ValueError(f"CenterNorm needs dim >= 2, got {dim}")
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, z: Tensor) -> Tensor:
        centred = z - z.mean(dim=-1, keepdim=True)
        return (self.dim / (self.dim - 1)) * centred * self.weight + self.bias


#: timm's ``VisionTransformer`` passes its attention options to every block; at these values they describe what the
#: mixers do, any other value is refused by ``Block`` rather than ignored.
_TIMM_BLOCK_DEFAULTS = dict(
    qkv_bias=True, qk_norm=False, scale_attn_norm=False, scale_mlp_norm=False, proj_bias=True, init_values=None,
    proj_drop=0.0, attn_drop=0.0,
)


class Block(nn.Module):
    """Pre-norm Transformer block whose token mixer is any registered mixer; timm's ``block_fn``.

    Attribute names follow timm's ``Block`` (``norm1``, ``attn``, ``norm2``, ``mlp``), so a timm ViT state dict loads
    into an MHA model unchanged. Like timm's EVA block, which takes its rotary embedding as an argument, it is called
    with the patch grid of the tokens, ``block(z, grid)``, and hands it to its mixer with the prefix-token count; it
    keeps no state between calls, so gradient checkpointing, two forwards at different grids before one backward
    and nested models need nothing more. Two ways to apply it:

    - ``forward``: the residual block ``z + Mixer(N1(z))``, then ``+ MLP(N2(.))`` (discrete and looped families);
    - ``vector_field``: the parallel form ``Mixer(N1(z)) + MLP(N2(z))`` (the ODE family's ``f`` before scaling).

    Args:
        dim: token width ``D``.
        num_heads: heads ``H``.
        mlp_ratio: MLP hidden width over ``D``.
        mixer: mixer name (``ssogvit.layers.list_mixers()``).
        num_prefix_tokens: class and register tokens in front of the patches (``None``: whatever is not a patch).
        mixer_options: keyword options for ``create_mixer``.
        drop_path: stochastic-depth rate of both residual branches.
        norm_layer: builds a norm from ``D`` (timm passes its LayerNorm).
        block_norm: builds ``N1`` and ``N2`` instead of ``norm_layer`` (the ODE family's CenterNorm).
        act_layer: MLP activation.
        mlp_layer: MLP class.
        **timm_options: the rest of what timm's ``VisionTransformer`` passes to a block; accepted at ViT's defaults.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        *,
        mixer: str,
        num_prefix_tokens: int | None = None,
        mixer_options: dict[str, Any] | None = None,
        drop_path: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = layer_norm,
        block_norm: Callable[[int], nn.Module] | None = None,
        act_layer: Callable[[], nn.Module] = nn.GELU,
        mlp_layer: Callable[..., nn.Module] = Mlp,
        **timm_options: Any,
    ) -> None:
        super().__init__()
        for key in ("attn_layer", "depth", "device", "dtype"):  # timm's own attention class, its index, placement
            timm_options.pop(key, None)
        changed = {k: v for k, v in timm_options.items() if _TIMM_BLOCK_DEFAULTS.get(k, object()) != v}
        if changed:
            raise ValueError(f"ssogvit blocks do not support the timm block option(s) {changed}")
        norm = block_norm or norm_layer
        self.num_prefix_tokens = num_prefix_tokens
        self.norm1 = norm(dim)
        self.attn = create_mixer(mixer, dim, num_heads, **(mixer_options or {}))
        self.norm2 = norm(dim)
        self.mlp = mlp_layer(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    @property
    def mixer(self) -> nn.Module:
        """The token mixer (stored as ``attn``, timm's name)."""
        return self.attn

    def mix(self, x: Tensor, grid: tuple[int, int] | None) -> Tensor:
        """The mixer on ``x (B, P + Gh*Gw, D)`` over the patch grid ``(Gh, Gw)``, with the block's prefix count."""
        if grid is None:
            raise ValueError("a block needs the patch grid of its tokens: call block(z, grid=(Gh, Gw))")
        return self.attn(x, grid=grid, num_prefix_tokens=self.num_prefix_tokens)

    def forward(
        self, z: Tensor, grid: tuple[int, int] | None = None, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        """Residual block ``(B, T, D) -> (B, T, D)`` on tokens over ``grid`` (no mask: mixing is over the image)."""
        if attn_mask is not None or is_causal:
            raise ValueError("ssogvit blocks take no attention mask or causal flag")
        z = z + self.drop_path1(self.mix(self.norm1(z), grid))
        return z + self.drop_path2(self.mlp(self.norm2(z)))

    def vector_field(self, z: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """Parallel form ``Mixer(N1(z)) + MLP(N2(z))`` on tokens over ``grid``."""
        return self.mix(self.norm1(z), grid) + self.mlp(self.norm2(z))


class BlockStack(nn.Sequential):
    """The discrete ViT's blocks, applied in turn to tokens over one grid: ``stack(z, grid)``; indexing and slicing
    are ``nn.Sequential``'s (state-dict keys ``blocks.{i}.*``, as timm's)."""

    def forward(self, z: Tensor, grid: tuple[int, int]) -> Tensor:  # type: ignore[override]
        for block in self:
            z = block(z, grid)
        return z


def _no_mask(attn_mask: Tensor | None, is_causal: bool) -> None:
    if attn_mask is not None or is_causal:
        raise ValueError("ssogvit models take no attention mask or causal flag")


def _init_linear(module: nn.Module) -> None:
    # timm ViT's default init for the MLP and the head; mixers keep their own initialisation.
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def _image_size(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``img_size`` as ``(H, W)``."""
    pair = tuple(to_2tuple(size))
    if len(pair) != 2:
        raise ValueError(f"img_size must be an int or (H, W), got {size!r}")
    return int(pair[0]), int(pair[1])


def check_fit(img_size: tuple[int, int], patch_size: int, *, dynamic_img_pad: bool = False) -> None:
    """``InputError`` unless ``patch_size`` fits ``img_size`` and (without ``dynamic_img_pad``) divides it: the one
    rule of the constructor, ``set_patch_size`` and ``set_input_size``, so a model never declares a size it refuses
    to run (docs/models.md)."""
    if img_size[0] < patch_size or img_size[1] < patch_size:
        raise InputError(f"patch_size {patch_size} does not fit img_size {img_size}", argument="patch_size")
    if (img_size[0] % patch_size or img_size[1] % patch_size) and not dynamic_img_pad:
        raise InputError(f"patch_size {patch_size} does not divide img_size {img_size}: the model would refuse "
                         "images of its own size; give a patch_size that divides img_size (or dynamic_img_pad=True "
                         "to pad)", argument="patch_size")


#: from_pretrained's check of a saved folder (`registry._check_saved_folder`, set there: the registry builds on this
#: module, and every model is made after `ssogvit.models` has imported it)
SAVED_FOLDER_CHECK: list[Callable[[Path, str], None]] = []


def _loadable(folder: str | Path, name: str, stage: Path) -> None:
    """``InputError`` unless ``from_pretrained`` takes the saved folder written in ``stage`` (its own check)."""
    from ssogvit.documents import DocumentError

    try:
        SAVED_FOLDER_CHECK[0](stage, name)
    except DocumentError as err:
        detail = str(err).split("config.json: ", 1)[-1]
        raise InputError(f"save_pretrained: from_pretrained would refuse the folder ({detail}); nothing was written "
                         f"to {folder}", argument="save_directory") from None


#: what ``save_pretrained`` writes into its folder (timm's hub layout); a folder holding anything else is not replaced
SAVED_FILES = ("config.json", "model.safetensors")


def write_saved_folder(folder: str | Path, model: nn.Module, *, model_args: dict[str, Any],
                       config: dict[str, Any] | None = None, model_config: dict[str, Any] | None = None,
                       overwrite: bool = True, check: Callable[[Path], None] | None = None) -> Path:
    """The one writer of every ``save_pretrained`` folder (ssogvit's models, ``ssogify``'d timm models): timm's
    ``save_for_hf`` (``config.json``, ``model.safetensors``), then the weights file sealed (``seal_file``) with
    ``config`` (default: what ``config.json`` states, its ``architecture`` as ``name`` and its ``model_args``) and the
    whole ``config.json`` as its sealed copy, so every loader checks both (docs/models.md, "Saved and exported
    weights").
    Written through ``replace_folder`` (``SAVED_FILES``); with ``overwrite=False`` a folder that holds a saved model
    already is refused (``FileExistsError``). ``check(stage)``, the loader's own validation, runs on the written
    folder before it takes ``folder``'s place: a folder its loader would refuse is never written."""
    existing = [f for f in SAVED_FILES if (Path(folder) / f).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{folder} already holds {existing}; save with overwrite=True to replace them")

    def write(stage: Path) -> None:
        save_for_hf(model, str(stage), model_config=model_config, model_args=model_args, safe_serialization=True)
        document = json.loads((stage / "config.json").read_text())
        stated = {"name": document["architecture"], **document.get("model_args", {})}
        seal_file(stage / "model.safetensors", stated if config is None else config, copy=document)
        if check is not None:
            check(stage)

    return replace_folder(folder, write, owned=SAVED_FILES)


class VisionTransformerBase(TimmVisionTransformer):
    """timm's ``VisionTransformer`` with a registered mixer in every block; the base of the three families.

    Everything of timm's ViT API is timm's own (``forward_features``, ``forward_head(x, pre_logits)``, ``pool``,
    ``reset_classifier``, ``set_grad_checkpointing``, ``forward_intermediates``, ``prune_intermediate_layers``,
    ``group_matcher``, features_only through ``timm.create_model``). The families differ only in ``self.blocks``:
    ``L`` blocks (vit), one block looped ``T`` times (looped), one block as an ODE field (ode); each presents itself as
    a sequence of ``depth`` block applications, which is what timm's intermediates and checkpointing walk over.

    Token order: ``[class, registers..., patches (row-major)]``. The position embedding covers the class token and the
    patches (timm's layout without registers); register tokens carry no position. Any image size divisible by the
    patch size runs: the patch part of the position embedding is resized bicubically on the fly (the parameter itself
    is unchanged). The class token is there whatever ``global_pool`` says; only the head's input changes. The final
    norm comes before pooling (``fc_norm=False``) for both pools.

    Args:
        embed_dim: token width ``D``.
        num_heads: heads ``H``.
        depth: block applications: blocks ``L`` (vit), loop steps ``T`` (looped), steps of the time grid (ode).
        mixer: mixer name from the mixer registry (``ssogvit.layers.list_mixers()``).
        mixer_options: keyword options passed to ``create_mixer`` for every block.
        img_size: training image size (int or ``(H, W)``); other sizes run with a resized position embedding.
        patch_size: square patch side.
        in_chans: image channels.
        num_classes: classes of the linear head (0: no head).
        num_registers: register tokens after the class token.
        global_pool: what the head reads: ``"token"`` the class token, ``"avg"`` the mean of the normalised patch
            tokens (class and register tokens excluded); ``None`` (default): the head that suits the mixer
            (``ssogvit.layers.default_pool``: ``"avg"`` for SSoG, whose class token cannot select and under whose
            class-token head the last block's field gets no gradient; ``"token"`` for the attention mixers). The
            paper's configs set ``"token"`` (docs/models.md, "The default head"); ``""``: no pooling, the head
            applied to every token (what ``reset_classifier(n, "")`` and ``prune_intermediate_layers`` leave).
        drop_path_rate: stochastic depth (what it means is the family's: see ``_steps``).
        mlp_ratio: MLP hidden width over ``D``.
        dynamic_img_size: timm's keyword, accepted for code that passes it to every timm ViT; the models take any
            image size whatever it says (the position embedding is resized on the fly), so it is not recorded.
        dynamic_img_pad: pad an image the patch does not divide on the right and bottom (timm's ``PatchEmbed``),
            instead of refusing it; recorded in ``config`` when set.
        name: registry name recorded in ``config``.
        **options: the family's own options (``family_options``).

    ``config`` is the one record of how the model was built (``create_model(**config)`` rebuilds it): the name, the
    options above, the family's options and the mixer options, updated by every in-place conversion.

    A family supplies how its blocks are applied and nothing else: ``family``, ``family_options`` (its own options and
    their defaults), ``shared_block`` (one block's weights for all ``depth`` applications) and the hooks
    ``_check_options``, ``_block_norm`` and ``_steps``.
    """

    family: ClassVar[str] = ""
    #: the family's own constructor options and their defaults, after the shared ones
    family_options: ClassVar[dict[str, Any]] = {}
    #: the family's options that only some settings of the others use (``specs.AppliesOnly``), refused where unused
    option_applies: ClassVar[dict[str, AppliesOnly]] = {}
    #: one block's weights applied ``depth`` times (looped, ode) instead of ``depth`` blocks (vit)
    shared_block: ClassVar[bool] = False

    @checked
    def __init__(
        self,
        *,
        embed_dim: Annotated[int, EMBED_DIM] = 768,
        num_heads: Annotated[int, NUM_HEADS] = 12,
        depth: Annotated[int, DEPTH] = 12,
        mixer: str = "mha",
        mixer_options: dict[str, Any] | None = None,
        img_size: Annotated[int | tuple[int, int], IntOrPair(IMG_SIZE)] = 224,
        patch_size: Annotated[int, PATCH_SIZE] = 16,
        in_chans: Annotated[int, IN_CHANS] = 3,
        num_classes: Annotated[int, NUM_CLASSES] = 1000,
        num_registers: Annotated[int, NUM_REGISTERS] = 0,
        global_pool: Annotated[str | None, Choice((*GLOBAL_POOLS, ""), none=True)] = None,
        drop_path_rate: Annotated[float, DROP_RATE] = 0.0,
        mlp_ratio: Annotated[float, MLP_RATIO] = 4.0,
        dynamic_img_size: Annotated[bool, Flag()] = True,
        dynamic_img_pad: Annotated[bool, Flag()] = False,
        name: str | None = None,
        **options: Any,
    ) -> None:
        unknown = [k for k in options if k not in self.family_options]
        if unknown:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}")
        given = options
        options = self._check_options({**self.family_options, **options}, drop_path_rate=drop_path_rate)
        check_applies(self.option_applies, {k: options[k] for k in given}, self.family_options, options)
        mixer_options = dict(mixer_options or {})
        global_pool = default_pool(mixer) if global_pool is None else global_pool
        img_size = _image_size(img_size)  # the config's one form, (H, W): what timm's writer records of any model
        config = dict(
            embed_dim=embed_dim, num_heads=num_heads, depth=depth, img_size=img_size, patch_size=patch_size,
            in_chans=in_chans, num_classes=num_classes, num_registers=num_registers, global_pool=global_pool,
            drop_path_rate=drop_path_rate, mlp_ratio=mlp_ratio, **options, **mixer_options,
        )
        if dynamic_img_pad:  # recorded only when set, so every config written before it stays as it was
            config["dynamic_img_pad"] = True
        if embed_dim % num_heads != 0:
            raise InputError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})",
                             argument="num_heads")
        check_fit(img_size, patch_size, dynamic_img_pad=dynamic_img_pad)
        self._check_parameter_memory(embed_dim, depth, img_size, patch_size, in_chans, num_classes, mlp_ratio)
        if name is None:  # built directly: name a registered size; config's explicit widths override it
            size = next((k for k, v in SIZES.items() if v[:2] == (embed_dim, num_heads)), "base")
            name = f"{self.family}-{size}-{mixer}"
        block_fn = partial(Block, mixer=mixer, mixer_options=mixer_options, num_prefix_tokens=1 + num_registers,
                           block_norm=self._block_norm(options))
        try:
            super().__init__(
                img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
                global_pool=global_pool, embed_dim=embed_dim, depth=1 if self.shared_block else depth,
                num_heads=num_heads, mlp_ratio=mlp_ratio, reg_tokens=num_registers, fc_norm=False,
                dynamic_img_size=True, dynamic_img_pad=dynamic_img_pad,
                drop_path_rate=0.0 if self.shared_block else drop_path_rate,
                weight_init="skip", block_fn=block_fn,
            )
        except (TypeError, ValueError) as err:
            raise InputError(f"{name}: cannot build mixer {mixer!r} with options {mixer_options}: {err}",
                             argument="mixer_options") from err
        self.num_heads = num_heads
        self.depth = depth
        self.mixer_name = mixer
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_registers = num_registers
        self.config = {"name": name, **config}
        # timm's layout gives registers a position too; ours covers the class token and the patches only
        self.pos_embed = nn.Parameter(torch.empty(1, 1 + self.patch_embed.num_patches, embed_dim))
        mean, std = (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD) if in_chans == 3 else ((0.5,) * in_chans,) * 2
        self.pretrained_cfg = self.default_cfg = dict(  # timm's description of the model's input and head
            architecture="ssogvit_" + name.replace("-", "_"), input_size=(in_chans, *img_size), mean=mean, std=std,
            num_classes=num_classes, first_conv="patch_embed.proj", classifier="head", fixed_input_size=False,
            interpolation="bicubic", crop_pct=1.0, license="apache-2.0",
        )
        self._set_steps(self._steps(self.blocks, drop_path_rate=drop_path_rate))
        self.init_weights()

    def _check_parameter_memory(self, embed_dim: int, depth: int, img_size: tuple[int, int], patch_size: int,
                                in_chans: int, num_classes: int, mlp_ratio: float) -> None:
        """Refuse, before allocating, a model whose parameters alone cannot fit in this machine's memory (counted
        from below: the blocks' projections and MLPs, patch and position embeddings, head; not on the meta device)."""
        if torch.get_default_device().type == "meta":
            return
        d, blocks = embed_dim, 1 if self.shared_block else depth
        tokens = (img_size[0] // patch_size) * (img_size[1] // patch_size) + 1
        n = blocks * (2 + 2 * mlp_ratio) * d * d + in_chans * patch_size**2 * d + tokens * d + d * num_classes
        nbytes = n * torch.get_default_dtype().itemsize
        check_memory(nbytes, f"a model of at least {n:,.0f} parameters",
                     f"embed_dim={embed_dim}, depth={depth}, img_size={img_size}, patch_size={patch_size}")

    def forward_bytes(self, batch: int, img_size: int | tuple[int, int]) -> int:
        """A lower bound on the bytes one inference forward of ``batch`` images of ``img_size`` needs: the images
        (float32) and, alive at once inside a block, the tokens, their normalised copy and the MLP's hidden units."""
        h, w = _image_size(img_size)
        tokens = (h // self.patch_size) * (w // self.patch_size) + self.num_prefix_tokens
        itemsize = next(self.parameters()).element_size()
        per_token = self.embed_dim * (2 + float(self.config.get("mlp_ratio", 4.0))) * itemsize
        return int(batch * (self.in_chans * h * w * 4 + tokens * per_token))

    # -- what a family supplies ------------------------------------------------------------------------------------

    def _check_options(self, options: dict[str, Any], *, drop_path_rate: float) -> dict[str, Any]:
        """Validate the family's options (all of ``family_options``, given or default) before anything is built;
        returns them as they go into ``config``."""
        return options

    def _block_norm(self, options: dict[str, Any]) -> Callable[[int], nn.Module] | None:
        """What builds the block's norms ``N1``, ``N2`` (``None``: timm's LayerNorm)."""
        return None

    def _steps(self, blocks: nn.Sequential, *, drop_path_rate: float) -> nn.Module:
        """The sequence of ``depth`` block applications built from timm's blocks (``depth`` blocks, or one with
        ``shared_block``), called as ``steps(z, grid)``; the discrete ViT applies each block once, with timm's
        linearly rising drop path."""
        return BlockStack(*blocks)

    def _set_steps(self, blocks: nn.Module) -> None:
        """Install a block sequence; timm's feature_info lists one entry per block application."""
        self.blocks = blocks
        self.feature_info = [
            dict(module=f"blocks.{i}", num_chs=self.embed_dim, reduction=self.patch_size) for i in range(self.depth)
        ]

    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        """timm's ViT init for tokens, position embedding, MLPs and head; mixers keep their own initialisation.

        Args:
            mode: only ``""``: the SSoG mixers' initialisation is part of the method (cold-started steering).
            needs_reset: unused (timm's signature).
        """
        if mode:
            raise ValueError(f"ssogvit models have one initialisation; got mode={mode!r}")
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        for block in self.modules():
            if isinstance(block, Block):
                block.mlp.apply(_init_linear)
        self.head.apply(_init_linear)

    # -- shape bookkeeping -----------------------------------------------------------------------------------------

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patch grid ``(Gh, Gw)`` at ``img_size``."""
        return tuple(self.patch_embed.grid_size)

    def mixers(self) -> list[nn.Module]:
        """Unique mixer modules, in order of application."""
        return [m.attn for m in self.modules() if isinstance(m, Block)]

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Full names of parameters excluded from weight decay: tokens, position embedding, norms, biases (every
        parameter with at most one dimension) and what each SSoG mixer names (``SSoGAttention.no_weight_decay``)."""
        skip = {"pos_embed", "cls_token", "reg_token"}
        for prefix, module in self.named_modules():
            if is_ssog(module):
                skip |= {f"{prefix}.{name}" for name in module.no_weight_decay()}
        return {name for name, p in self.named_parameters() if p.ndim <= 1 or name in skip}

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's: keep the block applications up to the last of ``indices``; ``depth`` and the config follow."""
        take = super().prune_intermediate_layers(indices, prune_norm=prune_norm, prune_head=prune_head)
        self._set_depth(len(self.blocks))
        return take

    def _set_depth(self, depth: int) -> None:
        self.depth = self.config["depth"] = depth
        self.feature_info = self.feature_info[:depth]

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's: a new head for ``num_classes`` (0: none), optionally another pool (``"token"``, ``"avg"``, or
        ``""`` for none); the config follows, so ``create_model(**config)`` rebuilds the model."""
        num_classes = NUM_CLASSES.check(num_classes, "num_classes")
        if global_pool is not None and global_pool not in (*GLOBAL_POOLS, ""):
            raise InputError(f"unknown global_pool {global_pool!r}; expected one of {GLOBAL_POOLS} or ''",
                             argument="global_pool")
        super().reset_classifier(num_classes, global_pool)
        # timm records fc_norm for rebuilding its own ViT; ours always normalise before pooling (no such option)
        getattr(self, "_model_args", {}).pop("fc_norm", None)
        self.config["num_classes"] = num_classes
        if global_pool is not None:  # "" too: no pooling (what prune_intermediate_layers' prune_head asks for)
            self.config["global_pool"] = global_pool

    def save_pretrained(self, save_directory: str | Path, *, overwrite: bool = True) -> Path:
        """Write the model in the Hugging Face hub layout (timm's ``save_for_hf``): ``config.json`` (architecture,
        ``model_args`` = this model's config, pretrained config) and ``model.safetensors``, sealed: its header holds
        the config and one digest covers it and the weights (``ssogvit.models.sealed``); ``config.json`` is checked
        against it on every load.

        A second save into the same folder replaces it, as timm's and Hugging Face's do, atomically: the folder is
        written whole beside it and renamed into place (``ssogvit.outputs.replace_folder``), never half written.

        Load it back with ``ssogvit.models.from_pretrained(save_directory)`` or
        ``timm.create_model(f"local-dir:{save_directory}", pretrained=True)``.

        Args:
            overwrite: ``False`` refuses a folder that holds a saved model already (``FileExistsError``).

        Raises:
            FileExistsError: ``save_directory`` is a file or a link, or a folder that holds anything but a saved
                model's two files (it is not replaced), or a saved model while ``overwrite`` is ``False``.
        """
        model_args = {k: v for k, v in self.config.items() if k != "name"}
        return write_saved_folder(save_directory, self, model_args=model_args, config=self.config,
                                  overwrite=overwrite, check=partial(_loadable, save_directory, self.config["name"]))

    # -- forward ---------------------------------------------------------------------------------------------------

    def _pos_embed(self, x: Tensor) -> Tensor:
        """Patch grid ``(B, Gh, Gw, D)`` -> tokens ``(B, P + Gh*Gw, D)`` with position."""
        b, gh, gw, d = x.shape
        pos = transfer.resize_pos_embed(self.pos_embed, self.grid_size, (gh, gw), num_prefix_tokens=1)
        parts = [self.cls_token.expand(b, -1, -1) + pos[:, :1]]
        if self.reg_token is not None:
            parts.append(self.reg_token.expand(b, -1, -1))
        parts.append(x.reshape(b, gh * gw, d) + pos[:, 1:])
        return self.pos_drop(torch.cat(parts, dim=1))  # (B, P + N, D)

    def embed(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images ``(B, C, H, W)`` -> tokens ``(B, P + N, D)`` with position embedding, and their grid ``(Gh, Gw)``,
        which every block application takes as an argument."""
        check_images(x)
        if x.shape[1] != self.in_chans:
            raise InputError(f"images {tuple(x.shape)} have {x.shape[1]} channels; this model takes {self.in_chans}",
                             argument="images")
        h, w = x.shape[-2:]
        p = self.patch_size
        if (h % p or w % p) and not self.patch_embed.dynamic_img_pad:
            raise InputError(f"image size {h}x{w} is not divisible by the patch size {p} "
                             "(dynamic_img_pad=True pads it instead)", argument="images")
        patches = self.patch_embed(x)  # (B, Gh, Gw, D)
        grid = (patches.shape[1], patches.shape[2])
        return self.norm_pre(self.patch_drop(self._pos_embed(patches))), grid

    def apply_steps(self, z: Tensor, grid: tuple[int, int], steps: nn.Module | None = None) -> Tensor:
        """Tokens over ``grid`` through ``steps`` (default: all of ``blocks``), each step checkpointed when
        gradient checkpointing is on (the grid is an argument of each checkpointed call, so a recomputation
        sees the grid of its own forward)."""
        steps = self.blocks if steps is None else steps
        if not self.grad_checkpointing:
            return steps(z, grid)
        for step in steps:
            z = checkpoint(step, z, grid)
        return z

    def forward_features(
        self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False, *, pre_norm: bool = False
    ) -> Tensor:
        """timm's: images -> tokens ``(B, P + N, D)``, after the final norm unless ``pre_norm``."""
        _no_mask(attn_mask, is_causal)
        z, grid = self.embed(x)
        z = self.apply_steps(z, grid)
        return z if pre_norm else self.norm(z)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]] | dict[str, Any]:
        """timm's (the arguments and outputs of ``timm.models.VisionTransformer.forward_intermediates``): the
        tokens after the block applications ``indices`` (last ``n`` if an int, all if ``None``), as ``NCHW`` maps
        or ``NLC`` patch tokens, with or without the final ``norm`` and the prefix tokens."""
        _no_mask(attn_mask, is_causal)
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take, last = feature_take_indices(len(self.blocks), indices)
        z, grid = self.embed(x)
        taken = []
        for i, step in enumerate(self.blocks[: last + 1] if stop_early else self.blocks):
            z = checkpoint(step, z, grid) if self.grad_checkpointing else step(z, grid)
            if i in take:
                taken.append(self.norm(z) if norm else z)
        p = self.num_prefix_tokens
        prefix, maps = [t[:, :p] for t in taken], [t[:, p:] for t in taken]
        if output_fmt == "NCHW":  # (B, N, D) -> (B, D, Gh, Gw)
            maps = [t.reshape(t.shape[0], *grid, -1).permute(0, 3, 1, 2).contiguous() for t in maps]
        if output_dict:
            out: dict[str, Any] = {"image_intermediates": maps}
            if return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                out["image_features"] = self.norm(z)
            return out
        if return_prefix_tokens:
            maps = list(zip(maps, prefix))
        return maps if intermediates_only else (self.norm(z), maps)

    # -- transfer --------------------------------------------------------------------------------------------------

    @checked
    def set_grad_checkpointing(self, enable: Annotated[bool, Flag()] = True) -> None:
        """timm's, its flag checked (a string such as 'no' switched checkpointing on)."""
        super().set_grad_checkpointing(enable)

    @checked
    def set_patch_size(self, patch_size: int, rescale_field: Annotated[bool, Flag()] = False) -> None:
        """Convert the model to another patch size in place, without retraining (docs/models.md).

        The patch-embedding kernel is resized with the FlexiViT pseudo-inverse, the position embedding bicubically to
        the new grid at ``img_size``; with ``rescale_field`` the SSoG centres ``mu``, widths ``sigma`` and the
        steering radius are multiplied by the grid ratio so each Gaussian covers the same image area.
        """
        patch_size = PATCH_SIZE.check(patch_size, "patch_size")
        check_fit(self.img_size, patch_size, dynamic_img_pad=self.patch_embed.dynamic_img_pad)
        self._set_patch_size(patch_size, rescale_field)

    def _set_patch_size(self, patch_size: int, rescale_field: bool) -> None:
        if patch_size == self.patch_size:
            return
        old_grid = self.grid_size
        transfer.resize_patch_embed(self.patch_embed, patch_size)
        new_grid = self.grid_size
        with torch.no_grad():
            pos = transfer.resize_pos_embed(self.pos_embed.detach(), old_grid, new_grid, num_prefix_tokens=1)
        self.pos_embed = nn.Parameter(pos, requires_grad=self.pos_embed.requires_grad)
        if rescale_field:
            self.rescale_field(new_grid[0] / old_grid[0], new_grid[1] / old_grid[1])
        self.patch_size = patch_size
        self.config["patch_size"] = patch_size

    @checked
    def rescale_field(self, factor_y: Annotated[float, GRID_RATIO], factor_x: Annotated[float, GRID_RATIO]) -> None:
        """Scale every SSoG field by a grid ratio in place (``SSoGAttention.rescale_field``), so each Gaussian covers
        the same image area on a grid ``factor`` times finer; a model without SSoG is left alone. The steering
        radius is an option, not a parameter: it is recorded in ``config`` so ``create_model(**config)`` rebuilds
        this model."""
        ssog = [m for m in self.mixers() if is_ssog(m)]
        for mixer in ssog:  # every field checked before any changes: a refusal leaves the model as it was
            mixer.rescaled_field(factor_y, factor_x)
        for mixer in ssog:
            mixer.rescale_field(factor_y, factor_x)
        if ssog and ssog[0].steer:
            self.config["radius"] = ssog[0].radius

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size: int | None = None) -> None:
        """timm's: make ``img_size`` (and ``patch_size``, see ``set_patch_size``) the model's own, resizing the
        position embedding of the class token and the patches (registers carry none) bicubically."""
        if patch_size is not None:
            if not isinstance(patch_size, int):
                raise ValueError(f"ssogvit models have square patches: give patch_size as an int, got {patch_size!r}")
            patch_size = PATCH_SIZE.check(patch_size, "patch_size")
        new_size = self.img_size if img_size is None else _image_size(img_size)
        check_fit(new_size, self.patch_size if patch_size is None else patch_size,
                  dynamic_img_pad=self.patch_embed.dynamic_img_pad)
        if patch_size is not None:
            self._set_patch_size(patch_size, False)
        if img_size is None:
            return
        old_grid = self.grid_size
        img_size = new_size
        self.patch_embed.set_input_size(img_size=img_size)
        with torch.no_grad():
            pos = transfer.resize_pos_embed(self.pos_embed.detach(), old_grid, self.grid_size, num_prefix_tokens=1)
        self.pos_embed = nn.Parameter(pos, requires_grad=self.pos_embed.requires_grad)
        self.img_size = img_size
        self.config["img_size"] = self.img_size
        self.pretrained_cfg = {**self.pretrained_cfg, "input_size": (self.in_chans, *self.img_size)}

    def extra_repr(self) -> str:
        return (
            f"family={self.family}, mixer={self.mixer_name}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"depth={self.depth}, img_size={self.img_size}, patch_size={self.patch_size}"
        )
