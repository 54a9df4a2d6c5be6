"""A loss curve as a PNG, with no plotting library: axes with numbered ticks, axis labels, a
title and the curve, drawn into a NumPy array and written with zlib. Text is drawn with a
tiny bitmap font defined here (5 x 7 glyphs, two more rows for descenders)."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from ..outputs import write_file

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 96, 36, 48, 64  # margins: tick labels left and below, title above
SCALE = 2  # every font pixel is SCALE x SCALE image pixels

INK, GRID, CURVE = (36, 41, 47), (225, 228, 232), (9, 105, 218)

# Each glyph: nine rows of five columns, '#' on. Rows 0-6 hold digits and capitals' height,
# rows 2-6 lower case, rows 7-8 descenders. Only the characters the plot writes.
_ROWS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###. ..... .....",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###. ..... .....",
    "2": ".###. #...# ....# ...#. ..#.. .#... ##### ..... .....",
    "3": "####. ....# ....# .###. ....# ....# ####. ..... .....",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#. ..... .....",
    "5": "##### #.... ####. ....# ....# #...# .###. ..... .....",
    "6": "..##. .#... #.... ####. #...# #...# .###. ..... .....",
    "7": "##### ....# ...#. ..#.. .#... .#... .#... ..... .....",
    "8": ".###. #...# #...# .###. #...# #...# .###. ..... .....",
    "9": ".###. #...# #...# .#### ....# ...#. .##.. ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##.. ..... .....",
    ",": "..... ..... ..... ..... ..... .##.. .##.. ..#.. .#...",
    "-": "..... ..... ..... .###. ..... ..... ..... ..... .....",
    "e": "..... ..... .###. #...# ##### #.... .###. ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. ..... ..... .....",
    " ": "..... ..... ..... ..... ..... ..... ..... ..... .....",
    "a": "..... ..... .###. ....# .#### #...# .#### ..... .....",
    "g": "..... ..... .#### #...# #...# #...# .#### ....# .###.",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###. ..... .....",
    "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###. ..... .....",
    "n": "..... ..... ####. #...# #...# #...# #...# ..... .....",
    "o": "..... ..... .###. #...# #...# #...# .###. ..... .....",
    "p": "..... ..... ####. #...# #...# #...# ####. #.... #....",
    "r": "..... ..... #.##. ##..# #.... #.... #.... ..... .....",
    "s": "..... ..... .#### #.... .###. ....# ####. ..... .....",
    "t": ".#... .#... ####. .#... .#... .#..# ..##. ..... .....",
}
FONT = {char: np.array([[c == "#" for c in row] for row in rows.split()], dtype=bool)
        for char, rows in _ROWS.items()}
GLYPH_HEIGHT, GLYPH_WIDTH = 9, 5


def text_mask(text: str, scale: int = SCALE) -> np.ndarray:
    """The pixels of `text` (True where ink), one blank column between glyphs."""
    columns = []
    for char in text:
        columns += [FONT.get(char, FONT[" "]), np.zeros((GLYPH_HEIGHT, 1), dtype=bool)]
    mask = np.hstack(columns[:-1]) if columns else np.zeros((GLYPH_HEIGHT, 0), dtype=bool)
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def draw_text(image: np.ndarray, text: str, x: int, y: int, anchor: str = "left",
              rotate: bool = False, colour=INK) -> None:
    """Writes `text` with its top at row `y`, starting at column `x` ('left'), centred on
    it ('centre') or ending at it ('right'); `rotate` turns it to read upwards."""
    mask = text_mask(text)
    if rotate:
        mask = np.rot90(mask)
    height, width = mask.shape
    if anchor == "centre":
        x -= width // 2
    elif anchor == "right":
        x -= width
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + height, image.shape[0]), min(x + width, image.shape[1])
    if y1 > y0 and x1 > x0:
        image[y0:y1, x0:x1][mask[y0 - y:y1 - y, x0 - x:x1 - x]] = colour


def nice_ticks(low: float, high: float, most: int = 7) -> tuple[float, list[float]]:
    """A step of 1, 2 or 5 times a power of ten and the multiples of it from low to high,
    at most `most` of them (at least two where low < high)."""
    span = high - low
    if span <= 0:
        return 1.0, [low]
    power = 10 ** math.floor(math.log10(span / most))
    for factor in (1, 2, 5, 10, 20, 50):
        step = factor * power
        first = math.ceil(low / step - 1e-9)
        count = math.floor(high / step + 1e-9) - first + 1
        if count <= most:
            break
    return step, [(first + i) * step for i in range(count)]


def tick_label(value: float, step: float) -> str:
    """A tick's number with as many decimals as the step needs."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    text = f"{value:.{decimals}f}"
    return text.lstrip("-") if text.strip("-0.") == "" else text  # no "-0.0"


def layout(losses: list[float]):
    """The plot's ranges and ticks: ((x range), x ticks, (y range), y ticks, y step)."""
    steps = len(losses)
    x_range = (1.0, float(max(steps, 2)))
    x_step, x_ticks = nice_ticks(*x_range)
    if x_step < 1:  # steps are whole numbers
        x_ticks = [float(s) for s in range(1, int(x_range[1]) + 1)]
    finite = [v for v in losses if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if high - low < 1e-6 * max(abs(high), 1.0):
        low, high = low - 0.5, high + 0.5
    y_step, _ = nice_ticks(low, high, 6)  # the axis runs from a tick below to one above
    first, last = math.floor(low / y_step + 1e-9), math.ceil(high / y_step - 1e-9)
    y_ticks = [i * y_step for i in range(first, last + 1)]
    return x_range, x_ticks, (y_ticks[0], y_ticks[-1]), y_ticks, y_step


def _line(image: np.ndarray, x0: int, y0: int, x1: int, y1: int, colour) -> None:
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for t in range(steps + 1):
        x = round(x0 + (x1 - x0) * t / steps)
        y = round(y0 + (y1 - y0) * t / steps)
        image[max(y - 1, 0):y + 1, max(x - 1, 0):x + 1] = colour


def loss_image(losses: list[float]) -> np.ndarray:
    image = np.full((HEIGHT, WIDTH, 3), 255, dtype=np.uint8)
    (x_low, x_high), x_ticks, (y_low, y_high), y_ticks, y_step = layout(losses)
    right, bottom = WIDTH - RIGHT, HEIGHT - BOTTOM

    def column(step: float) -> int:
        return round(LEFT + (step - x_low) / (x_high - x_low) * (right - LEFT))

    def row(loss: float) -> int:
        return round(TOP + (y_high - loss) / (y_high - y_low) * (bottom - TOP))

    text_height = GLYPH_HEIGHT * SCALE
    for tick in y_ticks:  # grid line, tick mark and label at each loss
        y = row(tick)
        image[y, LEFT:right] = GRID
        image[y, LEFT - 5:LEFT] = INK
        draw_text(image, tick_label(tick, y_step), LEFT - 9, y - 7 * SCALE // 2, "right")
    for tick in x_ticks:  # and at each step
        x = column(tick)
        image[TOP:bottom, x] = GRID
        image[bottom:bottom + 5, x] = INK
        draw_text(image, f"{int(tick)}", x, bottom + 9, "centre")
    image[bottom, LEFT:right + 1] = INK  # axes
    image[TOP:bottom + 1, LEFT] = INK

    draw_text(image, "step", (LEFT + right) // 2, bottom + 9 + text_height + 4, "centre")
    draw_text(image, "loss", 8, (TOP + bottom) // 2 - len("loss") * 6 * SCALE // 2,
              rotate=True)
    count = len(losses)
    draw_text(image, f"training loss, {count} step{'' if count == 1 else 's'}",
              (LEFT + right) // 2, (TOP - 7 * SCALE) // 2, "centre")

    points = [(column(i + 1), row(loss)) if math.isfinite(loss) else None
              for i, loss in enumerate(losses)]
    for first, second in zip(points, points[1:]):
        if first and second:
            _line(image, *first, *second, CURVE)
    for point in points if len(points) == 1 else ():
        if point:
            x, y = point
            image[y - 2:y + 3, x - 2:x + 3] = CURVE
    return image


def write_png(path: str, image: np.ndarray) -> bool:
    """Whether it was written whole (outputs.write_file)."""
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    return write_file(path, b"".join((
        b"\x89PNG\r\n\x1a\n",
        chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)),
        chunk(b"IDAT", zlib.compress(raw, 9)),
        chunk(b"IEND", b""))), "the plot")


def write_loss_plot(path: str, losses: list[float]) -> bool:
    return write_png(path, loss_image(losses))
