"""A loss curve as a PNG, with no plotting library: a line on a grid, written with zlib."""

from __future__ import annotations

import struct
import zlib

import numpy as np

WIDTH, HEIGHT, MARGIN = 720, 400, 40


def _line(image: np.ndarray, x0: int, y0: int, x1: int, y1: int, colour) -> None:
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for t in range(steps + 1):
        x = round(x0 + (x1 - x0) * t / steps)
        y = round(y0 + (y1 - y0) * t / steps)
        image[max(y - 1, 0):y + 1, max(x - 1, 0):x + 1] = colour


def loss_image(losses: list[float]) -> np.ndarray:
    image = np.full((HEIGHT, WIDTH, 3), 255, dtype=np.uint8)
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    for fraction in np.linspace(0, 1, 6):  # a light grid, five bands each way
        y = int(MARGIN + fraction * (HEIGHT - 2 * MARGIN))
        x = int(MARGIN + fraction * (WIDTH - 2 * MARGIN))
        image[y, MARGIN:WIDTH - MARGIN] = (225, 228, 232)
        image[MARGIN:HEIGHT - MARGIN, x] = (225, 228, 232)
    image[HEIGHT - MARGIN, MARGIN:WIDTH - MARGIN] = (36, 41, 47)  # axes
    image[MARGIN:HEIGHT - MARGIN, MARGIN] = (36, 41, 47)
    count = max(len(losses) - 1, 1)
    points = [(int(MARGIN + i / count * (WIDTH - 2 * MARGIN)),
               int(MARGIN + (high - loss) / span * (HEIGHT - 2 * MARGIN)))
              for i, loss in enumerate(losses)]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        _line(image, x0, y0, x1, y1, (9, 105, 218))
    return image


def write_png(path: str, image: np.ndarray) -> None:
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    with open(path, "wb") as handle:
        handle.write(b"\x89PNG\r\n\x1a\n")
        handle.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        handle.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        handle.write(chunk(b"IEND", b""))


def write_loss_plot(path: str, losses: list[float]) -> None:
    write_png(path, loss_image(losses))
