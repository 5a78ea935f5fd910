"""Line plots (the loss curves of ``fsdp8 train``) drawn with matplotlib and saved as PNG."""

from __future__ import annotations

import math
from collections.abc import Sequence

# matplotlib's tab10 colors; the first series (train) is blue, the second (val) red.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DPI = 100


def save_line_plot(
    path,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "loss",
    width: int = 800,
    height: int = 500,
) -> None:
    """Write a ``width`` x ``height`` PNG with one line per series, a legend, axis labels
    and a title.

    Values that are NaN or infinite are skipped and the line joins their finite neighbours,
    so a series measured every N steps (say, validation loss) can share ``xs`` with one
    measured every step; a series with values at fewer than half of ``xs`` also gets a
    marker at each value."""
    for name, ys in series.items():
        if len(ys) != len(xs):
            raise ValueError(f"series {name!r} has {len(ys)} values but there are {len(xs)} xs")
    # Imported here: only rank 0 draws, once per run, and importing matplotlib takes a while.
    # A bare Figure on the Agg canvas needs no display and leaves pyplot's global state and
    # the user's chosen backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (name, ys) in enumerate(series.items()):
        points = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        sparse = 2 * len(points) < len(xs)
        ax.plot([x for x, _ in points], [y for _, y in points], label=name, color=PALETTE[i % len(PALETTE)],
                linewidth=2, marker="o" if sparse else None, markersize=5)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend()
    fig.savefig(path, format="png")
