#!/usr/bin/env python3
"""Plot a `memfit bench strategies --csv` table: memory ratio (x) against
time ratio (y) vs the no-plan row, one labelled point per strategy, plus
optional PyTorch points, as an SVG (standard library only). Convert to PNG
with any SVG renderer, e.g. `rsvg-convert -o out.png out.svg` (Debian
librsvg2-bin).

usage: tools/plot_strategies.py STRATEGIES.csv OUT.svg [TITLE] [--torch NAME=MEM,TIME ...]

PyTorch points are ratios too (PyTorch's own strategy vs PyTorch's plain
run), drawn as hollow squares so both tools' trade-offs show side by side.
They come from the CSV's `tool=pytorch` rows (which `memfit bench
strategies` writes when it finds the baseline) or from --torch.
"""
import csv
import sys
from xml.sax.saxutils import escape


def main():
    args = [a for a in sys.argv[1:]]
    torch = []
    while "--torch" in args:
        i = args.index("--torch")
        name, _, vals = args[i + 1].partition("=")
        m, t = vals.split(",")
        torch.append((name, float(m), float(t)))
        del args[i : i + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    src, out = args[0], args[1]
    title = args[2] if len(args) > 2 else src
    with open(src) as f:
        rows = []
        for r in csv.DictReader(f):
            if not r["time_ratio"]:
                continue  # a PyTorch row without a clean timing
            point = (r["strategy"], float(r["memory_ratio"]), float(r["time_ratio"]))
            if r.get("tool", "memfit") == "pytorch":
                if point[0] != "plain":
                    torch.append(point)
            else:
                rows.append(point)
    if not rows:
        sys.exit(f"{src}: no rows")
    pts = rows + torch
    w, h, left, right, top, bottom = 760, 520, 70, 230, 40, 60
    xmax = max(1.05, max(p[1] for p in pts) * 1.05)
    ymin = min(0.9, min(p[2] for p in pts) * 0.95)
    ymax = max(p[2] for p in pts) * 1.05
    sx = lambda x: left + x / xmax * (w - left - right)
    sy = lambda y: h - bottom - (y - ymin) / (ymax - ymin) * (h - top - bottom)
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    for i in range(11):
        x = xmax * i / 10
        svg.append(f'<line x1="{sx(x)}" y1="{top}" x2="{sx(x)}" y2="{h - bottom}" stroke="#eee"/>')
        svg.append(f'<text x="{sx(x)}" y="{h - bottom + 16}" text-anchor="middle">{x:.2f}</text>')
    for i in range(9):
        y = ymin + (ymax - ymin) * i / 8
        svg.append(f'<line x1="{left}" y1="{sy(y)}" x2="{w - right}" y2="{sy(y)}" stroke="#eee"/>')
        svg.append(f'<text x="{left - 6}" y="{sy(y) + 4}" text-anchor="end">{y:.2f}</text>')
    svg.append(
        f'<text x="{(left + w - right) / 2}" y="{h - 18}" text-anchor="middle">peak memory / no-plan peak</text>'
    )
    svg.append(
        f'<text x="18" y="{(top + h - bottom) / 2}" text-anchor="middle" transform="rotate(-90 18 {(top + h - bottom) / 2})">step time / no-plan step time</text>'
    )
    svg.append(f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" fill="none" stroke="#333"/>')
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939"]
    legend_y = top + 10
    for i, (name, m, t) in enumerate(rows):
        c = colours[i % len(colours)]
        svg.append(f'<circle cx="{sx(m)}" cy="{sy(t)}" r="5" fill="{c}"/>')
        svg.append(f'<circle cx="{w - right + 18}" cy="{legend_y}" r="5" fill="{c}"/>')
        svg.append(f'<text x="{w - right + 28}" y="{legend_y + 4}">{escape(name)}</text>')
        legend_y += 18
    for name, m, t in torch:
        svg.append(f'<rect x="{sx(m) - 5}" y="{sy(t) - 5}" width="10" height="10" fill="none" stroke="black"/>')
        svg.append(f'<text x="{sx(m) + 8}" y="{sy(t) - 6}" font-size="10">{escape(name)}</text>')
    if torch:
        svg.append(f'<rect x="{w - right + 13}" y="{legend_y - 5}" width="10" height="10" fill="none" stroke="black"/>')
        svg.append(f'<text x="{w - right + 28}" y="{legend_y + 4}">PyTorch (own ratios)</text>')
    svg.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(svg) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
