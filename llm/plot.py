"""Plot a run's loss curves: python -m llm.plot DIR [-o loss.png]

Reads DIR/main.log (llm.c's `s:%d trl:%f ...` and `s:%d tel:%f` lines) and draws train loss (blue) and
val loss (red) against step into a PNG. The PNG is drawn pixel by pixel and written with zlib, so
plotting needs nothing beyond NumPy.
"""
import argparse
import os
import re
import struct
import sys
import zlib

import numpy as np

# a 3x5 pixel font for the axis labels: each glyph is 5 rows of 3 bits
FONT = {"0": [7, 5, 5, 5, 7], "1": [2, 6, 2, 2, 7], "2": [7, 1, 7, 4, 7], "3": [7, 1, 3, 1, 7],
        "4": [5, 5, 7, 1, 1], "5": [7, 4, 7, 1, 7], "6": [7, 4, 7, 5, 7], "7": [7, 1, 1, 2, 2], "8": [7, 5, 7, 5, 7],
        "9": [7, 5, 7, 1, 7], ".": [0, 0, 0, 0, 2], "-": [0, 0, 7, 0, 0], " ": [0, 0, 0, 0, 0]}
W, H, MARGIN = 800, 500, 50
BLUE, RED, BLACK, GREY = (31, 119, 180), (214, 39, 40), (0, 0, 0), (220, 220, 220)


def read_log(path):
    """-> (train [(step, loss)], val [(step, loss)]) from a main.log."""
    train, val = [], []
    for line in open(path):
        if m := re.match(r"s:(\d+) trl:(\S+)", line):
            train.append((int(m.group(1)), float(m.group(2))))
        elif m := re.match(r"s:(\d+) tel:(\S+)", line):
            val.append((int(m.group(1)), float(m.group(2))))
    return train, val


def draw_line(img, x0, y0, x1, y1, color):
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.linspace(x0, x1, n).round().astype(int).clip(0, W - 1)
    ys = np.linspace(y0, y1, n).round().astype(int).clip(0, H - 1)
    img[ys, xs] = color


def draw_text(img, x, y, text, scale=2):
    for i, ch in enumerate(text):
        for r, bits in enumerate(FONT.get(ch, FONT[" "])):
            for c in range(3):
                if bits >> (2 - c) & 1:
                    x0, y0 = x + (i * 4 + c) * scale, y + r * scale
                    img[y0:y0 + scale, x0:x0 + scale] = BLACK


def write_png(path, img):
    raw = b"".join(b"\x00" + row.tobytes() for row in img)   # filter type 0 per scanline
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)) +
                chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def plot(train, val, path):
    points = train + val
    if not points:
        raise ValueError("no loss lines to plot")
    steps, losses = [s for s, _ in points], [v for _, v in points]
    s_lo, s_hi = min(steps), max(max(steps), min(steps) + 1)
    l_lo, l_hi = min(losses), max(max(losses), min(losses) + 1e-6)
    def xy(s, v):
        return (MARGIN + (s - s_lo) / (s_hi - s_lo) * (W - 2 * MARGIN),
                H - MARGIN - (v - l_lo) / (l_hi - l_lo) * (H - 2 * MARGIN))
    img = np.full((H, W, 3), 255, np.uint8)
    for k in range(5):   # grid lines with the loss and step values they stand for
        y = MARGIN + k * (H - 2 * MARGIN) / 4
        draw_line(img, MARGIN, y, W - MARGIN, y, GREY)
        draw_text(img, 4, int(y) - 5, f"{l_hi - k * (l_hi - l_lo) / 4:.2f}")
        x = MARGIN + k * (W - 2 * MARGIN) / 4
        draw_text(img, int(x) - 10, H - MARGIN + 8, f"{round(s_lo + k * (s_hi - s_lo) / 4)}")
    draw_line(img, MARGIN, H - MARGIN, W - MARGIN, H - MARGIN, BLACK)
    draw_line(img, MARGIN, MARGIN, MARGIN, H - MARGIN, BLACK)
    for series, color in ((train, BLUE), (val, RED)):
        for (s0, v0), (s1, v1) in zip(series, series[1:]):
            draw_line(img, *xy(s0, v0), *xy(s1, v1), color)
        for s, v in series if len(series) == 1 else ():
            x, y = xy(s, v)
            img[int(y) - 2:int(y) + 3, int(x) - 2:int(x) + 3] = color
    write_png(path, img)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot train (blue) and val (red) loss from DIR/main.log.")
    parser.add_argument("dir")
    parser.add_argument("-o", "--out", help="PNG to write (default DIR/loss.png)")
    args = parser.parse_args(argv)
    log = os.path.join(args.dir, "main.log")
    if not os.path.exists(log):
        print(f"error: {log}: no such file (train with -o {args.dir} first)", file=sys.stderr)
        return 1
    train, val = read_log(log)
    if not train and not val:
        print(f"error: {log}: no s:N trl:/tel: lines to plot", file=sys.stderr)
        return 1
    out = args.out or os.path.join(args.dir, "loss.png")
    plot(train, val, out)
    print(f"wrote {out}: {len(train)} train and {len(val)} val points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
