"""Unit tests for the PNG line plot: file structure, pixels, and the raster helpers."""

import math
import struct
import zlib

import pytest

from fsdp8.plot import PALETTE, encode_png, line_pixels, nice_ticks, save_line_plot, text_pixels


def read_png(path):
    """(width, height, rgb bytes) of an 8-bit RGB, unfiltered PNG, checking every CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, color_type) == (8, 2)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    rows = [raw[y * (1 + 3 * width) : (y + 1) * (1 + 3 * width)] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, b"".join(row[1:] for row in rows)


def colors(rgb):
    return {rgb[i : i + 3] for i in range(0, len(rgb), 3)}


def test_line_plot_is_a_valid_png_with_series_colors(tmp_path):
    path = tmp_path / "loss.png"
    xs = list(range(50))
    series = {"train": [5.5 * math.exp(-x / 10) for x in xs],
              "val": [5.0 - 0.05 * x if x % 10 == 0 else float("nan") for x in xs]}
    save_line_plot(path, xs, series, title="loss", width=320, height=200)
    width, height, rgb = read_png(path)
    assert (width, height) == (320, 200)
    present = colors(rgb)
    assert bytes(PALETTE[0]) in present and bytes(PALETTE[1]) in present
    assert bytes(PALETTE[2]) not in present


def test_plot_of_non_finite_or_empty_series(tmp_path):
    save_line_plot(tmp_path / "a.png", [0, 1], {"bad": [float("nan"), float("inf")]})
    save_line_plot(tmp_path / "b.png", [], {})
    assert read_png(tmp_path / "a.png")[:2] == (640, 400)


def test_plot_errors(tmp_path):
    with pytest.raises(ValueError, match="has 1 values"):
        save_line_plot(tmp_path / "c.png", [0, 1], {"short": [1.0]})
    with pytest.raises(ValueError, match="at least"):
        save_line_plot(tmp_path / "c.png", [0], {"a": [1.0]}, width=10)
    with pytest.raises(ValueError, match="RGB bytes"):
        encode_png(2, 2, b"\x00" * 11)


def test_line_pixels_are_connected_and_include_both_ends():
    for end in [(7, 3), (-4, 9), (0, 0), (5, -5)]:
        pixels = line_pixels(0, 0, *end)
        assert pixels[0] == (0, 0) and pixels[-1] == end
        assert all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) == 1 for a, b in zip(pixels, pixels[1:]))


def test_nice_ticks_and_text():
    assert nice_ticks(0.0, 10.0) == [0, 5, 10]
    assert nice_ticks(0.13, 0.91) == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert nice_ticks(1.0, 1.0) == [1.0]
    one = {(2, 0), (1, 1), (2, 1)} | {(2, y) for y in range(2, 6)} | {(x, 6) for x in range(1, 4)}
    assert set(text_pixels("1", 0, 0)) == one
    assert len(text_pixels("8", 0, 0, scale=2)) == 4 * len(text_pixels("8", 0, 0))
