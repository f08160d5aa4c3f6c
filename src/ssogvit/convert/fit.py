"""Fit each SSoG head's Gaussian field to its teacher head's attention, and say how Gaussian the teacher is.

For every block and head the teacher's attention rows of the patch queries, restricted to the patch keys and
renormalised (SSoG patches never read prefix tokens, docs/operator.md), are the target; the student mixer's dense
patch-to-patch matrix (``SSoGAttention.attention_matrix``, built by ``ssogvit.reference``) is fitted to them by
minimising the mean ``KL(teacher row || SSoG row)`` with Adam, in float64. A fixed field is one matrix for every image,
so its fit targets the mean teacher row (the same minimiser); a steered field is fitted image by image, its steering
maps and gates included.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ssogvit.results import markdown_table, pyplot, save_figure
from ssogvit.timm_compat import unique_blocks

from .student import attention_probs, record_mixer_inputs, teacher_grid

__all__ = ["FitResult", "fit_fields", "fit_mixer", "format_report", "plot_fit"]

_TINY = 1e-30


def _kl_rows(target: Tensor, pred: Tensor) -> Tensor:
    """``KL(target || pred)`` of each row ``(..., N) -> (...)``."""
    return (target * (target.clamp_min(_TINY).log() - pred.clamp_min(_TINY).log())).sum(-1)


def _patch_matrix(mixer: nn.Module, x: Tensor, grid: tuple[int, int]) -> Tensor:
    p = x.shape[1] - grid[0] * grid[1]
    return mixer.attention_matrix(x, grid, num_prefix_tokens=p)[:, :, p:, p:]  # (B, H, N, N)


def fit_mixer(mixer: nn.Module, x: Tensor, target: Tensor, grid: tuple[int, int], *, steps: int = 300,
              lr: float = 0.1, wide_start: bool = True, steered_images: int = 32) -> list[float]:
    """Fit ``mixer``'s field, in place, to patch-query attention rows.

    Args:
        mixer: an ``SSoGAttention``.
        x: mixer inputs ``(B, P + N, D)`` (the steering maps read them; a fixed field ignores them).
        target: teacher rows among patches ``(B, H, N, N)``, each row on the simplex.
        grid: ``(Gh, Gw)``.
        steps, lr: Adam steps and learning rate.
        wide_start: start from widths of half the grid's longer side (centres as they are): a narrow start puts
            almost no mass on most cells and the fit crawls (KL 18 nats at step 0 on an 8x8 grid, against 0.35).
        steered_images: a steered field is fitted on the first this many images (each step builds one dense
            matrix per image).

    Returns:
        The loss (mean KL in nats) at every step.
    """
    work = copy.deepcopy(mixer).double()
    x, target = x.detach().double(), target.detach().double()
    if not work.steer:  # one matrix for every image: the mean KL is the KL to the mean row plus a constant
        x, target = x[:1], target.mean(0, keepdim=True)
    else:
        x, target = x[:steered_images], target[:steered_images]
    if wide_start:
        with torch.no_grad():
            work.rho.fill_(max(grid) / 2)  # softplus(rho) ~ rho for large rho
    params = work.field_parameters()
    opt = torch.optim.Adam(params.values(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _kl_rows(target, _patch_matrix(work, x, grid)).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        for name, p in mixer.field_parameters().items():
            p.copy_(params[name])
    return losses


@dataclass
class FitResult:
    """What ``fit_fields`` measured.

    Attributes:
        rows: one dict per (block, head): ``kl`` (mean KL of the teacher rows from the fitted field, nats),
            ``kl_uniform`` (from the uniform row), ``explained`` (``1 - kl / kl_uniform``: the share of the
            teacher's departure from uniform that the Gaussians explain), ``kl_content`` (of the teacher rows from
            their own mean over images: what no fixed field can capture), ``prefix_mass`` (attention of patch
            queries on prefix tokens, which SSoG does not give), ``entropy`` (of the teacher rows).
        maps: ``(block, head) -> {"teacher_mean", "teacher_image", "field"}``, the centre query's row over the grid
            ``(Gh, Gw)`` (the field's for the first image).
        grid: ``(Gh, Gw)``.
        steps, lr: the fit's Adam steps per mixer and learning rate (0 steps: the fields were not fitted, the
            report's "fitted field" is the student's initial one).
    """

    rows: list[dict] = field(default_factory=list)
    maps: dict[tuple[int, int], dict[str, Tensor]] = field(default_factory=dict)
    grid: tuple[int, int] = (0, 0)
    steps: int = 0
    lr: float = 0.0


@torch.no_grad()
def _teacher_calls(teacher: nn.Module, images: Tensor) -> dict[int, list[tuple[Tensor, Tensor]]]:
    with record_mixer_inputs(teacher) as records:
        teacher(images)
    calls: dict[int, list[tuple[Tensor, Tensor]]] = defaultdict(list)
    for i, x in records:
        calls[i].append((x, attention_probs(unique_blocks(teacher)[i].attn, x)))
    return calls


def fit_fields(teacher: nn.Module, student: nn.Module, images: Tensor, *, steps: int = 300,
               lr: float = 0.1) -> FitResult:
    """Fit every student mixer's field to the teacher's attention on ``images``, in place, and report the fit.

    Args:
        teacher: the multi-head-attention ViT (in eval mode).
        student: its SSoG twin (``build_student``); ``student.blocks[i].attn`` is fitted to ``teacher.blocks[i].attn``
            (a looped model's one mixer to all its calls).
        images: calibration images ``(B, C, H, W)`` at the teacher's image size.
        steps, lr: Adam steps and learning rate per mixer.
    """
    grid = teacher_grid(teacher)
    if tuple(images.shape[-2:]) != tuple(g * p for g, p in zip(grid, teacher.patch_embed.patch_size)):
        raise ValueError(f"calibration images are {tuple(images.shape[-2:])} px; the teacher's grid {grid} needs "
                         f"{tuple(g * p for g, p in zip(grid, teacher.patch_embed.patch_size))} px")
    p, n = int(teacher.num_prefix_tokens), grid[0] * grid[1]
    centre = (grid[0] // 2) * grid[1] + grid[1] // 2
    result = FitResult(grid=grid, steps=int(steps), lr=float(lr))
    for i, calls in _teacher_calls(teacher, images).items():
        x = torch.cat([c[0] for c in calls]).double()
        rows = torch.cat([c[1] for c in calls]).double()[:, :, p:, :]  # (B', H, N, P + N): patch queries
        if rows.shape[-1] != p + n:
            raise ValueError(f"block {i} sees {rows.shape[-1]} tokens, expected {p} prefix + {n} patches")
        prefix_mass = rows[..., :p].sum(-1)  # (B', H, N)
        target = rows[..., p:] / rows[..., p:].sum(-1, keepdim=True)
        mixer = unique_blocks(student)[i].attn
        fit_mixer(mixer, x, target, grid, steps=steps, lr=lr)
        with torch.no_grad():
            fitted = _patch_matrix(copy.deepcopy(mixer).double(), x, grid).expand_as(target)
        mean = target.mean(0, keepdim=True)
        kl, kl_content = _kl_rows(target, fitted), _kl_rows(target, mean.expand_as(target))
        entropy = -(target * target.clamp_min(_TINY).log()).sum(-1)
        for h in range(target.shape[1]):
            kl_uniform = math.log(n) - float(entropy[:, h].mean())
            result.rows.append({
                "block": i, "head": h, "kl": float(kl[:, h].mean()), "kl_uniform": kl_uniform,
                "explained": 1.0 - float(kl[:, h].mean()) / kl_uniform if kl_uniform > 0 else float("nan"),
                "kl_content": float(kl_content[:, h].mean()), "prefix_mass": float(prefix_mass[:, h].mean()),
                "entropy": float(entropy[:, h].mean()),
            })
            result.maps[(i, h)] = {
                "teacher_mean": mean[0, h, centre].view(grid).float(),
                "teacher_image": target[0, h, centre].view(grid).float(),
                "field": fitted[0, h, centre].view(grid).float(),
            }
    return result


def format_report(result: FitResult) -> str:
    """A markdown report: one row per head, then the means."""
    keys = ("kl", "kl_uniform", "explained", "kl_content", "prefix_mass", "entropy")
    body = [[r["block"], r["head"], *(r[k] for k in keys)] for r in result.rows]
    mean = {k: sum(r[k] for r in result.rows) / max(len(result.rows), 1) for k in keys}
    n = result.grid[0] * result.grid[1]
    fitted = (f"Each student field was fitted by {result.steps} Adam steps (learning rate {result.lr:g}) to its "
              "teacher's attention." if result.steps else
              "**The fields were not fitted (convert.fit_steps=0): every 'KL fit' below is of the student's initial "
              "field, not of a fit.**")
    return (
        f"# How Gaussian is this ViT?\n\n{fitted}\n\nGrid {result.grid[0]}x{result.grid[1]} (uniform row entropy "
        f"{math.log(n):.3f} nats). Per head: KL (nats) of the teacher's patch-query attention rows (among patches) "
        "from the fitted Gaussian field and from the uniform row; explained = 1 - KL / KL(uniform); KL content = "
        "KL of the rows from their mean over images (what no fixed field can capture); prefix mass = attention "
        "of patch queries on prefix tokens (SSoG gives them none).\n\n"
        + markdown_table(["block", "head", "KL fit", "KL uniform", "explained", "KL content", "prefix mass",
                          "entropy"], body)
        + f"\nMean over heads: KL fit {mean['kl']:.4f}, KL uniform {mean['kl_uniform']:.4f}, explained "
        f"{mean['explained']:.3f}, KL content {mean['kl_content']:.4f}, prefix mass {mean['prefix_mass']:.3f}.\n"
    )


def plot_fit(result: FitResult, path: str | Path, *, heads: int = 6) -> Path:
    """PNG: for the best- and worst-explained heads, the teacher's attention of the centre query (mean over the
    calibration images, and one image) beside the fitted field's row."""
    plt = pyplot()
    ranked = sorted(result.rows, key=lambda r: -r["explained"] if math.isfinite(r["explained"]) else math.inf)
    chosen = ranked[: (heads + 1) // 2] + [r for r in ranked[-(heads // 2):] if r not in ranked[: (heads + 1) // 2]]
    columns = (("teacher_mean", "teacher, mean"), ("teacher_image", "teacher, one image"), ("field", "fitted field"))
    fig, axes = plt.subplots(len(chosen), 3, figsize=(6.0, 2.0 * len(chosen) + 0.3), squeeze=False,
                             layout="constrained")
    gh, gw = result.grid
    for row, r in zip(axes, chosen):
        maps = result.maps[(r["block"], r["head"])]
        vmax = max(float(maps[k].max()) for k, _ in columns)
        for ax, (key, title) in zip(row, columns):
            ax.imshow(maps[key].numpy(), cmap="viridis", vmin=0.0, vmax=vmax)
            ax.plot(gw // 2, gh // 2, "r+", ms=8)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(title, fontsize=8)
        row[0].set_ylabel(f"block {r['block']} head {r['head']}\nexplained {r['explained']:.2f}", fontsize=8)
    fig.suptitle("teacher attention of the centre query (+) and the fitted Gaussian field", fontsize=9)
    return save_figure(fig, path)
