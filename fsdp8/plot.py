"""Line plots written as PNG files with the standard library only (no matplotlib)."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

Color = tuple[int, int, int]
Pixels = list[tuple[int, int]]

WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)
PALETTE: list[Color] = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14),
                        (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207)]

# 5x7 bitmap font: seven rows of five bits each (two hex digits per row, top row first).
_FONT = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C", "A": "0E1111111F1111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F", "F": "1F10101E101010",
    "G": "0E11101711110F", "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C",
    "K": "11121418141211", "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D", "R": "1E11111E141211",
    "S": "0F10100E01011E", "T": "1F040404040404", "U": "1111111111110E", "V": "11111111110A04",
    "W": "1111111515150A", "X": "11110A040A1111", "Y": "1111110A040404", "Z": "1F01020408101F",
    ".": "00000000000C0C", "-": "0000001F000000", ":": "000C0C000C0C00", "+": "0004041F040400",
    "_": "0000000000001F", "/": "00010204081000", "(": "02040808080402", ")": "08040202020408",
    "=": "00001F001F0000", ",": "000000000C0408", "%": "18190204081303", " ": "00000000000000",
    "?": "0E110102040004",
}


def glyph_rows(char: str) -> list[int]:
    """The seven 5-bit rows of `char`; lowercase draws as uppercase, unknown characters as '?'."""
    code = _FONT.get(char.upper(), _FONT["?"])
    return [int(code[i : i + 2], 16) for i in range(0, 14, 2)]


def text_width(text: str, scale: int = 1) -> int:
    return max(0, 6 * len(text) - 1) * scale


def text_pixels(text: str, x: int, y: int, scale: int = 1) -> Pixels:
    """Pixels of `text` with its top-left corner at (x, y); glyphs are 5 wide plus 1 of spacing."""
    pixels = []
    for i, char in enumerate(text):
        for row, bits in enumerate(glyph_rows(char)):
            for col in range(5):
                if bits & (0x10 >> col):
                    px, py = x + (6 * i + col) * scale, y + row * scale
                    pixels += [(px + dx, py + dy) for dx in range(scale) for dy in range(scale)]
    return pixels


def line_pixels(x0: int, y0: int, x1: int, y1: int) -> Pixels:
    """Bresenham's line from (x0, y0) to (x1, y1), both ends included."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x1 >= x0 else -1), (1 if y1 >= y0 else -1)
    err, pixels = dx + dy, []
    while True:
        pixels.append((x0, y0))
        if (x0, y0) == (x1, y1):
            return pixels
        twice = 2 * err
        if twice >= dy:
            err, x0 = err + dy, x0 + sx
        if twice <= dx:
            err, y0 = err + dx, y0 + sy


def rect_pixels(x0: int, y0: int, x1: int, y1: int) -> Pixels:
    """A filled rectangle, corners included."""
    return [(x, y) for y in range(y0, y1 + 1) for x in range(x0, x1 + 1)]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (steps of 1, 2 or 5 times a power of ten) within [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def format_tick(value: float) -> str:
    return f"{value:.4g}"


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of `rgb` (row-major, 3 bytes per pixel, no filtering)."""
    if len(rgb) != 3 * width * height:
        raise ValueError(f"expected {3 * width * height} RGB bytes for {width}x{height}, got {len(rgb)}")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    stride = 3 * width
    # Each scanline starts with its filter type; 0 means none.
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class _Canvas:
    """An RGB raster; the only place pixels are written."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.rgb = bytearray(WHITE * (width * height))

    def paint(self, pixels: Pixels, color: Color) -> None:
        for x, y in pixels:
            if 0 <= x < self.width and 0 <= y < self.height:
                i = 3 * (y * self.width + x)
                self.rgb[i : i + 3] = bytes(color)


def save_line_plot(
    path,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    title: str = "",
    xlabel: str = "step",
    ylabel: str = "loss",
    width: int = 640,
    height: int = 400,
) -> None:
    """Write a PNG with one polyline per series.

    Values that are NaN or infinite are skipped and the line joins their finite neighbours,
    so a series measured every N steps (say, validation loss) can share `xs` with one
    measured every step.
    """
    if width < 160 or height < 120:
        raise ValueError(f"plot must be at least 160x120 pixels, got {width}x{height}")
    if len(series) > len(PALETTE):
        raise ValueError(f"at most {len(PALETTE)} series per plot, got {len(series)}")
    for name, ys in series.items():
        if len(ys) != len(xs):
            raise ValueError(f"series {name!r} has {len(ys)} values but there are {len(xs)} xs")

    finite = [y for ys in series.values() for y in ys if math.isfinite(y)]
    xlo, xhi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    ylo, yhi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    pad = (yhi - ylo) * 0.05 or 1.0
    ylo, yhi = ylo - pad, yhi + pad
    xticks, yticks = nice_ticks(xlo, xhi), nice_ticks(ylo, yhi)

    left = 12 + max(text_width(format_tick(t)) for t in yticks)
    top, right, bottom = (26 if title else 14), width - 16, height - 34

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (round(left + (x - xlo) / (xhi - xlo) * (right - left)),
                round(bottom - (y - ylo) / (yhi - ylo) * (bottom - top)))

    canvas = _Canvas(width, height)
    for t in yticks:
        _, py = to_px(xlo, t)
        canvas.paint(line_pixels(left, py, right, py), GRID)
        label = format_tick(t)
        canvas.paint(text_pixels(label, left - 6 - text_width(label), py - 3), BLACK)
    for t in xticks:
        px, _ = to_px(t, ylo)
        canvas.paint(line_pixels(px, top, px, bottom), GRID)
        label = format_tick(t)
        canvas.paint(text_pixels(label, px - text_width(label) // 2, bottom + 6), BLACK)
    canvas.paint(line_pixels(left, top, left, bottom) + line_pixels(left, bottom, right, bottom), BLACK)
    canvas.paint(text_pixels(title, (width - text_width(title, 2)) // 2, 6, scale=2), BLACK)
    canvas.paint(text_pixels(xlabel, (left + right - text_width(xlabel)) // 2, bottom + 20), BLACK)
    canvas.paint(text_pixels(ylabel, 4, top - 11), BLACK)

    for color, ys in zip(PALETTE, series.values()):
        points = [to_px(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        for a, b in zip(points, points[1:] or points):
            line = line_pixels(*a, *b)
            # Two pixels thick, so lines stay visible when the image is scaled down.
            canvas.paint(line + [(x, y + 1) for x, y in line], color)

    if series:
        box_w = 30 + max(text_width(name) for name in series)
        box_x, box_y = right - box_w - 6, top + 6
        canvas.paint(rect_pixels(box_x, box_y, box_x + box_w, box_y + 12 * len(series) + 4), WHITE)
        for i, (color, name) in enumerate(zip(PALETTE, series)):
            y = box_y + 6 + 12 * i
            canvas.paint(rect_pixels(box_x + 4, y, box_x + 20, y + 1), color)
            canvas.paint(text_pixels(name, box_x + 26, y - 3), BLACK)

    with open(path, "wb") as f:
        f.write(encode_png(width, height, bytes(canvas.rgb)))
