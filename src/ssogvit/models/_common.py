"""Pieces every model family shares (SPEC section 6): patch embedding, class / register tokens, absolute position
embedding, the pre-norm block, the final norm and the linear head.

The three families differ only in how they apply their blocks (``_forward_tokens``); the mixer inside a block is chosen
by name from the mixer registry, so an SSoG model and its baseline differ only in that name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timm.layers import DropPath, Mlp, PatchEmbed, resample_abs_pos_embed, trunc_normal_
from torch import Tensor, nn

from ssogvit.layers import create_mixer

from . import transfer

__all__ = ["GLOBAL_POOLS", "SIZES", "Block", "CenterNorm", "VisionTransformerBase", "layer_norm"]

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


def _call_mixer(
    mixer: nn.Module, x: Tensor, grid: tuple[int, int], num_prefix_tokens: int, return_attn: bool
) -> tuple[Tensor, Tensor | None]:
    if return_attn:
        y, attn = mixer(x, grid=grid, num_prefix_tokens=num_prefix_tokens, return_attn=True)
        return y, attn
    return mixer(x, grid=grid, num_prefix_tokens=num_prefix_tokens), None


class Block(nn.Module):
    """Pre-norm Transformer block whose token mixer is any registered mixer.

    Attribute names follow timm's ``Block`` (``norm1``, ``attn``, ``norm2``, ``mlp``), so a timm ViT state dict loads
    into an MHA model unchanged. Two ways to apply it:

    - ``forward``: the residual block ``z + Mixer(N1(z))``, then ``+ MLP(N2(.))`` (discrete and looped families);
    - ``vector_field``: the parallel form ``Mixer(N1(z)) + MLP(N2(z))`` (the ODE family's ``f`` before scaling).

    Args:
        dim: token width ``D``.
        num_heads: heads ``H``.
        mixer: mixer name (``ssogvit.layers.list_mixers()``).
        mixer_options: keyword options for ``create_mixer``.
        mlp_ratio: MLP hidden width over ``D``.
        drop_path: stochastic-depth rate of both residual branches.
        norm_layer: builds a norm from ``D``.
        num_prefix_tokens: class and register tokens in front of the patches; passed to the mixer, so that a grid
            that does not match the tokens is an error.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mixer: str,
        mixer_options: dict[str, Any] | None = None,
        mlp_ratio: float = 4.0,
        drop_path: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = layer_norm,
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.norm1 = norm_layer(dim)
        self.attn = create_mixer(mixer, dim, num_heads, **(mixer_options or {}))
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    @property
    def mixer(self) -> nn.Module:
        """The token mixer (stored as ``attn``, timm's name)."""
        return self.attn

    def forward(self, z: Tensor, grid: tuple[int, int], *, return_attn: bool = False) -> tuple[Tensor, Tensor | None]:
        """Residual block; returns ``(z, attn)`` with ``attn`` ``None`` unless ``return_attn``."""
        y, attn = _call_mixer(self.attn, self.norm1(z), grid, self.num_prefix_tokens, return_attn)
        z = z + self.drop_path1(y)
        z = z + self.drop_path2(self.mlp(self.norm2(z)))
        return z, attn

    def vector_field(
        self, z: Tensor, grid: tuple[int, int], *, return_attn: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Parallel form ``Mixer(N1(z)) + MLP(N2(z))``; returns ``(f, attn)``."""
        y, attn = _call_mixer(self.attn, self.norm1(z), grid, self.num_prefix_tokens, return_attn)
        return y + self.mlp(self.norm2(z)), attn


def _init_linear(module: nn.Module) -> None:
    # timm ViT's default init for the MLP and the head; mixers keep their own initialisation.
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def _pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    h, w = size
    return (int(h), int(w))


class VisionTransformerBase(nn.Module):
    """Embedding, tokens, final norm and head shared by the three families.

    Subclasses build ``self.blocks`` and implement ``_forward_tokens(z, grid, attns)``, which evolves the token sequence
    (appending one attention matrix per mixer application to ``attns`` when it is a list).

    Token order: ``[class, registers..., patches (row-major)]``. The position embedding covers the class token and the
    patches (timm's layout); register tokens carry no position. At an image size other than ``img_size`` the patch
    part of the position embedding is resized bicubically on the fly (the parameter itself is unchanged). The class
    token is there whatever ``global_pool`` says; only the head's input changes.
    """

    family: str = ""

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        depth: int,
        mixer: str,
        mixer_options: dict[str, Any] | None,
        img_size: int | tuple[int, int],
        patch_size: int,
        in_chans: int,
        num_classes: int,
        num_registers: int,
        global_pool: str,
        name: str | None,
        config: dict[str, Any],
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if num_registers < 0:
            raise ValueError(f"num_registers must be >= 0, got {num_registers}")
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"unknown global_pool {global_pool!r}; expected one of {GLOBAL_POOLS}")
        img_size = _pair(img_size)
        if patch_size < 1 or img_size[0] < patch_size or img_size[1] < patch_size:
            raise ValueError(f"patch_size {patch_size} does not fit img_size {img_size}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.depth = depth
        self.mixer_name = mixer
        self.mixer_options = dict(mixer_options or {})
        self.img_size = img_size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_registers = num_registers
        self.num_prefix_tokens = 1 + num_registers
        self.global_pool = global_pool
        if name is None:  # built directly: name a registered size; config's explicit widths override it
            size = next((k for k, v in SIZES.items() if v[:2] == (embed_dim, num_heads)), "base")
            name = f"{self.family}-{size}-{mixer}"
        self.config = {"name": name, **config}

        self.patch_embed = PatchEmbed(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, strict_img_size=False
        )
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.reg_token = nn.Parameter(torch.zeros(1, num_registers, embed_dim)) if num_registers else None
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, embed_dim))
        self.norm = layer_norm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def _init_weights(self) -> None:
        """timm's ViT init for tokens, position embedding, MLPs and head; mixers keep their own init."""
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        for block in self.blocks:
            block.mlp.apply(_init_linear)
        self.head.apply(_init_linear)

    def _make_block(self, **kwargs: Any) -> Block:
        try:
            return Block(
                self.embed_dim, self.num_heads, mixer=self.mixer_name, mixer_options=self.mixer_options,
                num_prefix_tokens=self.num_prefix_tokens, **kwargs
            )
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"{self.config['name']}: cannot build mixer {self.mixer_name!r} with options {self.mixer_options}: "
                f"{err}"
            ) from err

    # -- shape bookkeeping -----------------------------------------------------------------------------------------

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patch grid ``(Gh, Gw)`` at ``img_size``."""
        return tuple(self.patch_embed.grid_size)

    def mixers(self) -> list[nn.Module]:
        """Unique mixer modules, in order of application."""
        out: list[nn.Module] = []
        for block in self.blocks:
            if not any(block.attn is m for m in out):
                out.append(block.attn)
        return out

    def no_weight_decay(self) -> set[str]:
        """Full names of parameters excluded from weight decay: tokens, position embedding, norms, biases (every
        parameter with at most one dimension, steering gates included) and the SSoG field ``mu, rho, ell, theta``."""
        skip = {"pos_embed", "cls_token", "reg_token"}
        field = {"mu", "rho", "ell", "theta"}
        return {
            name
            for name, p in self.named_parameters()
            if p.ndim <= 1 or name in skip or name.rsplit(".", 1)[-1] in field
        }

    # -- forward ---------------------------------------------------------------------------------------------------

    def _pos_embed_for(self, grid: tuple[int, int]) -> Tensor:
        if grid == self.grid_size:
            return self.pos_embed
        return resample_abs_pos_embed(
            self.pos_embed, new_size=list(grid), old_size=list(self.grid_size), num_prefix_tokens=1
        )

    def embed(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images ``(B, C, H, W)`` -> tokens ``(B, P + N, D)`` with position embedding, and the grid ``(Gh, Gw)``."""
        if x.ndim != 4:
            raise ValueError(f"expected images of shape (B, C, H, W), got {tuple(x.shape)}")
        b, _, h, w = x.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image size {h}x{w} is not divisible by the patch size {p}")
        grid = (h // p, w // p)
        pos = self._pos_embed_for(grid)
        patches = self.patch_embed(x) + pos[:, 1:]  # (B, N, D)
        parts = [self.cls_token.expand(b, -1, -1) + pos[:, :1]]
        if self.reg_token is not None:
            parts.append(self.reg_token.expand(b, -1, -1))
        parts.append(patches)
        return torch.cat(parts, dim=1), grid  # (B, P + N, D)

    def _forward_tokens(self, z: Tensor, grid: tuple[int, int], attns: list[Tensor] | None) -> Tensor:
        raise NotImplementedError

    def forward_features(
        self, x: Tensor, *, return_attn: bool = False, pre_norm: bool = False
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Images -> tokens ``(B, P + N, D)``, after the final norm unless ``pre_norm``.

        With ``return_attn`` also returns a list with one ``(B, H, T, T)`` mixing matrix per mixer application.
        """
        z, grid = self.embed(x)
        attns: list[Tensor] | None = [] if return_attn else None
        z = self._forward_tokens(z, grid, attns)
        if not pre_norm:
            z = self.norm(z)
        return (z, attns) if return_attn else z

    def forward_head(self, tokens: Tensor) -> Tensor:
        """Normalised tokens -> logits: from the class token (``global_pool="token"``) or from the mean of the patch
        tokens, class and register tokens excluded (``"avg"``, timm's convention)."""
        if self.global_pool == "avg":
            return self.head(tokens[:, self.num_prefix_tokens :].mean(dim=1))
        return self.head(tokens[:, 0])

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    # -- transfer --------------------------------------------------------------------------------------------------

    def set_patch_size(self, patch_size: int, rescale_field: bool = False) -> None:
        """Convert the model to another patch size in place, without retraining (SPEC section 7).

        The patch-embedding kernel is resized with the FlexiViT pseudo-inverse, the position embedding bicubically to
        the new grid at ``img_size``; with ``rescale_field`` the SSoG centres ``mu``, widths ``sigma`` and the
        steering radius are multiplied by the grid ratio so each Gaussian covers the same image area.
        """
        if patch_size == self.patch_size:
            return
        if patch_size < 1 or patch_size > min(self.img_size):
            raise ValueError(f"patch_size {patch_size} does not fit img_size {self.img_size}")
        old_grid = self.grid_size
        transfer.resize_patch_embed(self.patch_embed, patch_size)
        new_grid = self.grid_size
        with torch.no_grad():
            pos = transfer.resize_pos_embed(self.pos_embed.detach(), old_grid, new_grid, num_prefix_tokens=1)
        self.pos_embed = nn.Parameter(pos, requires_grad=self.pos_embed.requires_grad)
        if rescale_field:
            fy, fx = new_grid[0] / old_grid[0], new_grid[1] / old_grid[1]
            for mixer in self.mixers():
                transfer.rescale_field(mixer, fy, fx)
            if self.mixers() and getattr(self.mixers()[0], "steer", ()):
                # The radius is an option, not a parameter: record it so create_model(**config) rebuilds this model.
                self.mixer_options["radius"] = self.config["radius"] = self.mixers()[0].radius
        self.patch_size = patch_size
        self.config["patch_size"] = patch_size

    def extra_repr(self) -> str:
        return (
            f"family={self.family}, mixer={self.mixer_name}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"depth={self.depth}, img_size={self.img_size}, patch_size={self.patch_size}"
        )
