"""Patch-size and resolution transfer without retraining (paper Table 13, docs/analysis.md).

A model trained at patch `p` on `S`-pixel images is evaluated at other patch sizes (patch embedding resized by the
FlexiViT pseudo-inverse, position embedding bicubically: `model.set_patch_size`) and at other image sizes (position
embedding resampled by the model), each with and without rescaling the SSoG field (`mu`, `sigma`, the steering
radius) by the ratio of the evaluation grid to the training grid, so that each Gaussian covers the same image area.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ssogvit import results
from ssogvit.layers import is_ssog

from ._common import mixer_grid


@torch.no_grad()
def accuracy(model: nn.Module, images: Tensor, labels: Tensor, *, batch_size: int = 128) -> float:
    """Top-1 accuracy of `model` on `images`."""
    model.eval()
    correct = 0
    for i in range(0, len(images), batch_size):
        correct += (model(images[i: i + batch_size]).argmax(-1) == labels[i: i + batch_size]).sum().item()
    return correct / max(1, len(images))


def default_patch_sizes(patch_size: int, img_size: int) -> list[int]:
    """The paper's 16 / 14 / 8 for a patch-16 model; otherwise the trained patch, half and double it."""
    cands = [16, 14, 8] if patch_size == 16 else [patch_size, patch_size // 2, 2 * patch_size]
    return [q for q in dict.fromkeys(cands) if 1 <= q <= img_size]


def eval_size(img_size: int, patch_size: int) -> int:
    """The image side used at `patch_size`: `img_size` when the patch divides it, else its nearest multiple."""
    return img_size if img_size % patch_size == 0 else max(1, round(img_size / patch_size)) * patch_size


def transferred(model: nn.Module, *, patch_size: int, img_size: int, rescale: bool) -> nn.Module:
    """A copy of `model` converted to `patch_size` for `img_size` images; with `rescale`, every SSoG field scaled by
    the grid ratio (evaluation grid over training grid)."""
    old = mixer_grid(model)
    m = copy.deepcopy(model)
    if patch_size != m.patch_size:
        m.set_patch_size(patch_size, rescale_field=False)
    if rescale:
        new = (img_size // patch_size, img_size // patch_size)
        m.rescale_field(new[0] / old[0], new[1] / old[1])
    return m.eval()


def transfer_table(
    model: nn.Module, images_at: Callable[[int], tuple[Tensor, Tensor]], *, patch_sizes: Sequence[int] | None = None,
    img_sizes: Sequence[int] = (),
) -> list[dict]:
    """Accuracy at other patch sizes (at the training image size) and other image sizes (at the training patch),
    with and without rescaling the field.

    Args:
        images_at: image side -> `(images, labels)` of the evaluation set at that size.
        patch_sizes: defaults to `default_patch_sizes`.
        img_sizes: extra image sides, evaluated at the training patch.

    Returns:
        Rows `{"kind", "patch", "img_size", "grid", "rescale", "top1"}`; the training setting once, as `"trained"`.
    """
    p0, s0 = int(model.patch_size), int(model.img_size[0])
    patch_sizes = default_patch_sizes(p0, s0) if patch_sizes is None else list(patch_sizes)
    field = any(is_ssog(m) for m in model.mixers())
    cache: dict[int, tuple[Tensor, Tensor]] = {}

    def data(s: int):
        if s not in cache:
            cache[s] = images_at(s)
        return cache[s]

    settings = [("trained", p0, s0)]
    settings += [("patch", q, eval_size(s0, q)) for q in patch_sizes if q != p0]
    settings += [("image", p0, eval_size(int(s), p0)) for s in img_sizes if eval_size(int(s), p0) != s0]
    rows = []
    for kind, q, s in dict.fromkeys(settings):
        for rescale in ((False, True) if field and kind != "trained" else (False,)):
            m = transferred(model, patch_size=q, img_size=s, rescale=rescale)
            x, y = data(s)
            rows.append({"kind": kind, "patch": q, "img_size": s, "grid": [s // q, s // q], "rescale": rescale,
                         "top1": accuracy(m, x, y)})
    return rows


def plot_transfer(tables: dict[str, list[dict]], path) -> object:
    """Top-1 against patch size (left) and image size (right), one line per model and rescaling choice."""
    from matplotlib.ticker import MaxNLocator

    plt = results.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 3.6))
    for ax, kind, key, xlabel in ((axes[0], "patch", "patch", "patch size (px)"),
                                  (axes[1], "image", "img_size", "image size (px)")):
        for k, (label, rows) in enumerate(tables.items()):
            trained = next(r for r in rows if r["kind"] == "trained")
            for rescale, ls in ((False, "-"), (True, "--")):
                pts = sorted((r[key], r["top1"]) for r in rows
                             if r is trained or (r["kind"] == kind and r["rescale"] == rescale))
                if rescale and len(pts) < 2:
                    continue
                ax.plot([v for v, _ in pts], [100 * a for _, a in pts], ls, marker="o", color=f"C{k}",
                        label=f"{label}{' (μ, σ rescaled)' if rescale else ''}")
            ax.axvline(trained[key], color="0.7", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("top-1 (%)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # patch and image sizes are whole pixels
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the panels: hides no line
    axes[0].set_title("other patch sizes, training image size (grey: trained)", fontsize=9)
    axes[1].set_title("other image sizes, training patch size", fontsize=9)
    fig.tight_layout()
    return results.save_figure(fig, path)
