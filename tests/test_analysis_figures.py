"""The analysis figures say what they show: every line in a legend, one colour scale, no line hidden by another."""

from __future__ import annotations

import matplotlib
import pytest
import torch

import ssogvit.results
from ssogvit.analysis.fields import plot_query_fields
from ssogvit.analysis.lipschitz import plot_lipschitz
from ssogvit.analysis.sinks import plot_sinks
from ssogvit.models import create_model

matplotlib.use("Agg")


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions would save, kept open for inspection."""
    kept = []

    def keep(fig, path):
        kept.append(fig)
        return path

    monkeypatch.setattr(ssogvit.results, "save_figure", keep)
    yield kept
    import matplotlib.pyplot as plt

    for fig in kept:
        plt.close(fig)


def test_every_steered_lipschitz_line_is_in_the_legend(figures):
    growth = [{"radius": r, "local_max": 2.0, "frozen_bound_max": 4.0} for r in (1.0, 2.0)]
    reports = {"s": {"fixed": [], "steered": [{"layer": f"block {i}", "growth": growth} for i in (0, 2, 3)]}}
    plot_lipschitz(reports, "unused.png")
    (ax,) = figures[0].axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(ax.get_lines()) == len(labels) == 6
    assert {f"s: local ||J||, block {i}" for i in (0, 2, 3)} <= set(labels)
    assert {f"s: frozen-geometry bound, block {i}" for i in (0, 2, 3)} <= set(labels)


def test_query_field_panels_share_one_colour_scale_with_a_colour_bar(figures):
    torch.manual_seed(0)
    kw = dict(img_size=16, patch_size=4, in_chans=1, num_classes=3, depth=2, embed_dim=16, num_heads=2)
    models = {m: create_model(f"vit-tiny-{m}", **kw) for m in ("ssog", "mha")}
    _, summary = plot_query_fields(models, torch.randn(1, 16, 16), "unused.png")
    fig = figures[0]
    overlays = [im for ax in fig.axes for im in ax.get_images() if im.get_cmap().name == "inferno"]
    assert len(overlays) == 4  # two models x two applications
    assert {im.get_clim() for im in overlays} == {(0.0, max(max(s["peak"]) for s in summary.values()))}
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1


def test_coinciding_sink_lines_stay_distinguishable(figures):
    same = {"sink_per_layer": [1.2, 1.3], "same_key_per_layer": [1.0, 1.0], "cls_mass_per_layer": [0.0, 0.0]}
    plot_sinks({"ssog": same, "mha": {**same, "same_key_per_layer": [0.3, 0.2]}, "ssog-steered": same},
               "unused.png")
    for ax in figures[0].axes:
        lines = [ln for ln in ax.get_lines() if ln.get_label() in ("ssog", "mha", "ssog-steered")]
        looks = {(ln.get_marker(), str(ln.get_linestyle()), ln.get_linewidth(), ln.get_markersize()) for ln in lines}
        assert len(looks) == 3  # no two models drawn alike
        first, last = lines[0], lines[-1]
        assert last.get_zorder() > first.get_zorder() and last.get_linewidth() < first.get_linewidth()
        assert last.get_markerfacecolor() == "none" and last.get_markersize() > first.get_markersize()
