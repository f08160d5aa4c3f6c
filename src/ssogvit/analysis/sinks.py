"""Attention-sink metrics (paper Table 5, docs/analysis.md) as functions of attention maps and tokens.

Every metric reads dense, row-stochastic mixing matrices `(B, H, T, T)` (one per mixer application, prefix tokens
first), so SSoG and MHA are measured the same way. Per-image statistics are computed batch by batch
(`per_image_sink_stats`) and summarised over the whole image set (`summarize_sink_stats`); `sink_metrics` does both
for one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssogvit import results
from ssogvit.models.maps import record_attention

HIGH_NORM_FACTOR = 3.0


def sink_score(attn: Tensor) -> Tensor:
    """Attention received by the most-attended key over the uniform share, per image (1 = no sink).

    Args:
        attn: `(B, H, T, T)` (averaged over heads first) or head-averaged `(B, T, T)`.

    Returns:
        `(B,)`: `T * max_k mean_q A[q, k]`, i.e. the largest column sum of the row-stochastic map.
    """
    a = attn.mean(1) if attn.ndim == 4 else attn  # (B, T, T)
    received = a.mean(-2)  # (B, T): mean over queries of the attention each key receives
    return received.amax(-1) * a.shape[-1]


def rollout(maps: Sequence[Tensor]) -> Tensor:
    """Residual attention rollout `prod_l (A_l + I) / 2` of head-averaged maps, later layers on the left.

    Returns:
        `(B, T, T)`, row-stochastic.
    """
    out = None
    for attn in maps:
        a = attn.mean(1) if attn.ndim == 4 else attn  # (B, T, T)
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        step = 0.5 * (a + eye)
        out = step if out is None else step @ out
    if out is None:
        raise ValueError("rollout needs at least one attention map")
    return out


def most_attended_key(attn: Tensor) -> Tensor:
    """Index of the key receiving the most attention, per image and head: `(B, H, T, T) -> (B, H)`."""
    return attn.mean(-2).argmax(-1)


def same_key_share(keys: Tensor) -> Tensor:
    """Share of images whose most-attended key is the head's most frequent one.

    Args:
        keys: `(B, ...)` integer key indices (e.g. `most_attended_key` of one layer, `(B, H)`).

    Returns:
        `(...)`: per head (or per any trailing index), in `[1/B, 1]`.
    """
    mode = keys.mode(0).values  # (...)
    return (keys == mode).double().mean(0)


def cls_mass(attn: Tensor, num_prefix_tokens: int = 1) -> Tensor:
    """Attention from patch queries to the class token (token 0), averaged over heads and patch queries: `(B,)`."""
    if num_prefix_tokens < 1:
        return torch.full(attn.shape[:1], float("nan"), dtype=torch.float64, device=attn.device)
    return attn[:, :, num_prefix_tokens:, 0].mean((1, 2))


def high_norm_share(tokens: Tensor, num_prefix_tokens: int = 1, factor: float = HIGH_NORM_FACTOR) -> Tensor:
    """Share of patch tokens whose norm exceeds `factor` times the per-image median patch-token norm, per image.

    Args:
        tokens: final pre-norm tokens `(B, P + N, D)`.

    Returns:
        `(B,)`.
    """
    norms = tokens[:, num_prefix_tokens:].double().norm(dim=-1)  # (B, N)
    median = norms.median(-1, keepdim=True).values
    return (norms > factor * median).double().mean(-1)


@torch.no_grad()
def per_image_sink_stats(maps: Sequence[Tensor], tokens: Tensor | None = None, num_prefix_tokens: int = 1) -> dict:
    """Per-image statistics of one batch, to be concatenated over batches and summarised.

    Args:
        maps: one `(B, H, T, T)` map per mixer application.
        tokens: final pre-norm tokens `(B, T, D)`, for the high-norm share (optional).

    Returns:
        Tensors with a leading image axis: `score (B, L)`, `rollout (B,)`, `key (B, L, H)`, `cls (B, L)`,
        `high_norm (B,)` (when `tokens` is given).
    """
    maps = [m.double() for m in maps]
    stats = {
        "score": torch.stack([sink_score(m) for m in maps], 1),
        "rollout": sink_score(rollout(maps)),
        "key": torch.stack([most_attended_key(m) for m in maps], 1),
        "cls": torch.stack([cls_mass(m, num_prefix_tokens) for m in maps], 1),
    }
    if tokens is not None:
        stats["high_norm"] = high_norm_share(tokens, num_prefix_tokens)
    return {k: v.cpu() for k, v in stats.items()}


def concat_sink_stats(batches: Sequence[dict]) -> dict:
    """Concatenate `per_image_sink_stats` of several batches along the image axis."""
    return {k: torch.cat([b[k] for b in batches], 0) for k in batches[0]}


def summarize_sink_stats(stats: dict) -> dict:
    """The Table 5 row from per-image statistics.

    Returns:
        Floats: `sink_mean` (per-layer score averaged over images, then over layers), `sink_worst` (largest
        per-layer score), `sink_rollout`, `same_key` (share, averaged over heads and layers), `cls_mass` (averaged
        over images and layers), `high_norm` (share of patch tokens), and per-layer lists `sink_per_layer`,
        `same_key_per_layer`, `cls_mass_per_layer`; `num_images`.
    """
    per_layer = stats["score"].mean(0)  # (L,)
    same_key = same_key_share(stats["key"]).mean(-1)  # (L,)
    cls = stats["cls"].mean(0)  # (L,)
    out = {
        "num_images": int(stats["score"].shape[0]),
        "sink_mean": per_layer.mean().item(),
        "sink_worst": per_layer.max().item(),
        "sink_worst_layer": int(per_layer.argmax()),
        "sink_rollout": stats["rollout"].mean().item(),
        "same_key": same_key.mean().item(),
        "cls_mass": cls.mean().item(),
        "high_norm": stats["high_norm"].mean().item() if "high_norm" in stats else None,
        "sink_per_layer": per_layer.tolist(),
        "same_key_per_layer": same_key.tolist(),
        "cls_mass_per_layer": cls.tolist(),
    }
    return out


def sink_metrics(maps: Sequence[Tensor], tokens: Tensor | None = None, num_prefix_tokens: int = 1) -> dict:
    """Table 5 metrics of one batch of attention maps (see `summarize_sink_stats` for the keys)."""
    return summarize_sink_stats(per_image_sink_stats(maps, tokens, num_prefix_tokens))


@torch.no_grad()
def sink_report(model, images: Tensor, *, batch_size: int = 32) -> dict:
    """Table 5 metrics of `model` over `images`, batch by batch (see `summarize_sink_stats`)."""
    model.eval()
    batches = []
    for i in range(0, len(images), batch_size):
        with record_attention(model) as maps:
            tokens = model.forward_features(images[i: i + batch_size], pre_norm=True)
        batches.append(per_image_sink_stats(maps, tokens, int(model.num_prefix_tokens)))
    return {**summarize_sink_stats(concat_sink_stats(batches)), "by_construction": constant_by_construction(model)}


def constant_by_construction(model) -> dict[str, str]:
    """The per-layer sink metrics that `model`'s mixers fix whatever the images (metric -> why), for the figure.

    With SSoG in every block, patches never attend to prefix tokens, so the CLS mass is 0; with fixed SSoG the field
    does not depend on the image, so every image's most-attended key is the same and the same-key share is 1
    (docs/operator.md, docs/analysis.md).
    """
    from ssogvit.layers import is_ssog

    mixers = list(model.mixers())
    if not mixers or not all(is_ssog(m) for m in mixers):
        return {}
    out = {"cls_mass_per_layer": "0 by construction: patches never attend to prefix tokens"}
    if not any(getattr(m, "steer", ()) for m in mixers):
        out["same_key_per_layer"] = "1 by construction: the fixed field does not depend on the image"
    return out


def plot_sinks(summaries: dict[str, dict], path) -> object:
    """Sink score, same-key share and CLS mass per mixer application, one line per model.

    A metric that a model's architecture fixes (`by_construction` of `sink_report`: SSoG's CLS mass 0, fixed SSoG's
    same-key share 1) is not drawn for it, and a panel no model is measured on is left out: the figure's caption says
    which constants are not drawn and why. Models that coincide otherwise stay visible: the first model is a thick,
    light line with small filled markers and each later one a thin line with larger hollow markers drawn on top.
    """
    from matplotlib.ticker import MaxNLocator

    plt = results.pyplot()
    metrics = (("sink_per_layer", "sink score (1 = no sink)"), ("same_key_per_layer", "same-key share"),
               ("cls_mass_per_layer", "CLS mass from patch queries"))
    fixed = {key: [(k, label, s["by_construction"][key]) for k, (label, s) in enumerate(summaries.items())
                   if s.get("by_construction", {}).get(key)] for key, _ in metrics}
    panels = [(key, title) for key, title in metrics if len(fixed[key]) < len(summaries)]  # drawn for some model
    notes = [f"{title}: {label} {why}" for key, title in metrics for _, label, why in fixed[key]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels) + 0.4, 4.0 + 0.22 * len(notes)),
                             squeeze=False, layout="constrained")
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1, 1, 1)))]
    for k, (label, s) in enumerate(summaries.items()):
        marker, line = styles[k % len(styles)]
        look = (dict(lw=4.0, alpha=0.45, ms=4) if k == 0 else
                dict(lw=1.4, ms=6 + 2 * k, mfc="none", mew=1.4))
        for ax, (key, _) in zip(axes[0], panels):
            if s.get("by_construction", {}).get(key):  # a constant the architecture fixes is not a measurement
                continue
            ax.plot(range(len(s[key])), s[key], marker=marker, ls=line, color=f"C{k}", zorder=2 + k, label=label,
                    **look)
    for ax, (key, title) in zip(axes[0], panels):
        if key == "sink_per_layer":
            ax.axhline(1.0, color="0.6", lw=0.8, ls="--")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("mixer application")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    if notes:  # the constants, once, under the panels (as a caption, not in place of a panel)
        fig.supxlabel("not drawn, fixed by the architecture:\n" + "\n".join(notes), fontsize=7)
    return results.save_figure(fig, path)
