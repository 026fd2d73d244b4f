"""Grouped bar charts for the benchmark reports (``bar_chart``, ``bar_panels``, ``draw_bars``)
and the PNG writer every plot uses (``save_figure``: 256 colours, so the results folder stays
small). Matplotlib is optional: without it the charts return None."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def bar_chart(
    path: Path, labels: list[str], series: dict[str, list[float | None]], ylabel: str, title: str
) -> Path | None:
    """Grouped bars (one group per label, one bar per series); None values are left out."""
    return bar_panels(path, [(title, ylabel, labels, series)])


Panel = tuple[str, str, list[str], dict[str, list[float | None]]]  # title, ylabel, labels, series


def bar_panels(path: Path, panels: list[Panel], ncols: int = 2) -> Path | None:
    """A grid of grouped bar charts (Agg backend); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, *panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def save_figure(fig, path: Path, dpi: int) -> Path:
    """Save a matplotlib figure as a 256-colour PNG (about a third of the RGBA file, the plots
    unchanged to the eye), so the results folder stays small enough to travel with the
    repository to the GPU machine."""
    fig.savefig(path, dpi=dpi)
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    palette.save(path, optimize=True)
    return path


def draw_bars(ax, title: str, ylabel: str, labels: list[str], series) -> None:
    """Grouped bars on an existing matplotlib axis (one panel of ``bar_panels``)."""
    _draw_panel(ax, title, ylabel, labels, series)


def _draw_panel(ax, title: str, ylabel: str, labels: list[str], series) -> None:
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for k, (name, values) in enumerate(series.items()):
        ys = [np.nan if v is None else v for v in values]
        bars = ax.bar(x + (k - (len(series) - 1) / 2) * width, ys, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(x, labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
