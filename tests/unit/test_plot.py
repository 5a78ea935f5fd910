"""The loss plot: a real PNG of the asked size, with the curves where the values put them."""

import math

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from PIL import Image

from fsdp8.app.train.plot import PALETTE, save_line_plot


def _pixels(path):
    """(height, width, 3) uint8 RGB of a PNG, decoded by Pillow (so it must be a valid one)."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def _where(rgb, color):
    """(rows, columns) of the pixels of exactly ``color`` (the inside of a 2-pixel line is exact)."""
    want = np.array([round(255 * c) for c in to_rgb(color)], dtype=np.uint8)
    return np.nonzero((rgb == want).all(axis=-1))


def test_loss_plot_is_a_png_with_both_curves(tmp_path):
    path = tmp_path / "loss.png"
    xs = list(range(1, 201))
    series = {"train": [5.5 * math.exp(-x / 40) + 0.5 for x in xs],
              "val": [5.0 - 0.02 * x if x % 50 == 0 else float("nan") for x in xs]}
    save_line_plot(path, xs, series, title="fsdp8 tiny", xlabel="step", ylabel="loss", width=640, height=400)
    rgb = _pixels(path)
    assert rgb.shape == (400, 640, 3)
    rows, cols = _where(rgb, PALETTE[0])
    assert len(rows) > 300  # the train line
    # It falls: its pixels on the left sit higher (smaller row) than those on the right.
    left, right = cols < np.percentile(cols, 20), cols > np.percentile(cols, 80)
    assert rows[left].mean() < rows[right].mean() - 100
    assert len(_where(rgb, PALETTE[1])[0]) > 20  # the val line and its markers
    assert len(_where(rgb, PALETTE[2])[0]) == 0  # no third series, no stray color
    # Text (title, labels, ticks): dark pixels above the plot area and left of it.
    dark = (rgb < 80).all(axis=-1)
    assert dark[:30].sum() > 50 and dark[:, :40].sum() > 50


def test_non_finite_or_empty_series_still_give_an_image(tmp_path):
    save_line_plot(tmp_path / "a.png", [0, 1], {"bad": [float("nan"), float("inf")]})
    save_line_plot(tmp_path / "b.png", [], {})
    assert _pixels(tmp_path / "a.png").shape == (500, 800, 3)
    assert _pixels(tmp_path / "b.png").shape == (500, 800, 3)


def test_a_series_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match="series 'short' has 1 values but there are 2 xs"):
        save_line_plot("unused.png", [0, 1], {"short": [1.0]})
