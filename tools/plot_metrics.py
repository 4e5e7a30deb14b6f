#!/usr/bin/env python3
"""Plot a memfit --metrics-jsonl or --metrics-csv file (told apart by the
.csv ending): mean train loss per epoch, val loss and val top-1 per epoch, as
an SVG (standard library only). Convert to PNG with any SVG renderer, e.g.
`rsvg-convert -o curve.png curve.svg` (librsvg, as docs/usage.md says).

usage: tools/plot_metrics.py METRICS.jsonl|METRICS.csv OUT.svg [TITLE]
"""
import csv
import json
import math
import sys
from collections import defaultdict


def rows(path):
    """The file's records as dicts: JSON lines, or CSV rows with the empty
    cells left out and the numbers parsed."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                out = {}
                for k, v in r.items():
                    if v not in ("", None):
                        try:
                            out[k] = float(v)
                        except ValueError:
                            out[k] = v
                if "epoch" in out:
                    out["epoch"] = int(out["epoch"])
                yield out
        return
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON ({e})")


def load(path):
    train = defaultdict(list)
    val = {}
    for r in rows(path):
        if "val_top1" in r:
            val[r["epoch"]] = (r["val_loss"], r["val_top1"])
        elif isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]):
            train[r["epoch"]].append(r["loss"])
    epochs = sorted(set(train) | set(val))
    if not epochs:
        sys.exit(f"{path}: no metrics lines")
    return epochs, {e: sum(v) / len(v) for e, v in train.items()}, val


def tick(v):
    """An axis label short enough to fit whatever the loss's magnitude:
    0.42, 12.3, 1234, 1.2e+05."""
    if v == 0:
        return "0"
    if abs(v) < 10:
        return f"{v:.2f}"
    if abs(v) < 100:
        return f"{v:.1f}"
    if abs(v) < 10000:
        return f"{v:.0f}"
    return f"{v:.1e}"


# Width of a character of the 13-pixel sans-serif labels, generously.
CHAR_W = 8


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    title = sys.argv[3] if len(sys.argv) > 3 else src
    epochs, train, val = load(src)
    losses = [v for v in list(train.values()) + [v[0] for v in val.values()] if math.isfinite(v)]
    lmax = max(losses, default=1.0) * 1.1 or 1.0
    labels = [tick(lmax * i / 5) for i in range(6)]
    # The left margin holds the widest loss label and the rotated axis
    # title beside it (at x = 18), so no label is clipped at the edge.
    W, H, R, T, B = 900, 420, 70, 50, 60
    L = max(70, 30 + 8 + CHAR_W * max(map(len, labels)))
    pw, ph = W - L - R, H - T - B
    e0, e1 = min(epochs), max(epochs)
    xs = lambda e: L + (e - e0) / max(e1 - e0, 1) * pw
    yl = lambda v: T + ph - v / lmax * ph
    accs = [v[1] for v in val.values()]
    amin = min(0.8, min(accs) - 0.02) if accs else 0.8
    ya = lambda v: T + ph - (v - amin) / (1.0 - amin) * ph
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="13">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W/2}" y="25" text-anchor="middle" font-size="16">{title}</text>',
         f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="black"/>']
    for e in epochs:
        s.append(f'<line x1="{xs(e)}" y1="{T+ph}" x2="{xs(e)}" y2="{T+ph+5}" stroke="black"/>')
        s.append(f'<text x="{xs(e)}" y="{T+ph+20}" text-anchor="middle">{e}</text>')
    s.append(f'<text x="{L+pw/2}" y="{H-15}" text-anchor="middle">epoch</text>')
    for i in range(6):
        v = lmax * i / 5
        s.append(f'<text x="{L-8}" y="{yl(v)+4}" text-anchor="end">{labels[i]}</text>')
        a = amin + (1 - amin) * i / 5
        s.append(f'<text x="{L+pw+8}" y="{ya(a)+4}">{100*a:.0f}%</text>')
    s.append(f'<text x="18" y="{T+ph/2}" transform="rotate(-90 18 {T+ph/2})" text-anchor="middle">loss</text>')
    s.append(f'<text x="{W-15}" y="{T+ph/2}" transform="rotate(90 {W-15} {T+ph/2})" text-anchor="middle">val top-1</text>')

    def line(points, colour, dash=""):
        if points:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            s.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="2" {dash}/>')
            for x, y in points:
                s.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')

    line([(xs(e), yl(train[e])) for e in epochs if e in train and math.isfinite(train[e])], "#1f77b4")
    line([(xs(e), yl(val[e][0])) for e in epochs if e in val and math.isfinite(val[e][0])], "#ff7f0e",
         'stroke-dasharray="6,4"')
    line([(xs(e), ya(val[e][1])) for e in epochs if e in val], "#2ca02c")
    for i, (name, colour) in enumerate([("train loss (epoch mean)", "#1f77b4"),
                                        ("val loss", "#ff7f0e"), ("val top-1 (right axis)", "#2ca02c")]):
        y = T + 20 + 20 * i
        s.append(f'<line x1="{L+pw-230}" y1="{y}" x2="{L+pw-200}" y2="{y}" stroke="{colour}" stroke-width="2"/>')
        s.append(f'<text x="{L+pw-192}" y="{y+4}">{name}</text>')
    s.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
