"""Draw a sharedmem.trace file (Chrome trace JSON) as an SVG timeline: one row per stream,
one box per submission (submitted -> retired), a tick for each wait on another stream.

    python3 benchmarks/trace_svg.py run.json docs/timeline.svg
"""

import json
import sys
from html import escape


def main(src: str, dst: str) -> None:
    evs = json.load(open(src))["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs if e["ph"] == "M"}
    slices = [e for e in evs if e["ph"] == "X"]
    waits = [e for e in evs if e["ph"] == "i"]
    t_end = max((e["ts"] + e["dur"] for e in slices), default=1.0) or 1.0
    tids = sorted(names)
    left, width, row, top = 330, 900, 34, 30
    scale = width / t_end
    y_of = {tid: top + i * row for i, tid in enumerate(tids)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
           f'height="{top + row * len(tids) + 40}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="18">sharedmem.trace: submitted -> retired, per stream '
           f'({t_end / 1e3:.1f} ms)</text>']
    for tid in tids:
        y = y_of[tid]
        out.append(f'<text x="5" y="{y + 18}">{escape(names[tid][:52])}</text>')
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y + row - 4}" '
                   f'y2="{y + row - 4}" stroke="#ddd"/>')
    palette = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]
    for e in slices:
        y = y_of.get(e["tid"], top)
        x, w = left + e["ts"] * scale, max(1.0, e["dur"] * scale)
        color = palette[hash(e["name"]) % len(palette)]
        out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{row - 12}" '
                   f'fill="{color}" opacity="0.8"><title>{escape(e["name"])} '
                   f'({e["dur"]:.0f} us)</title></rect>')
        if w > 60:
            out.append(f'<text x="{x + 3:.1f}" y="{y + 19}" fill="white">'
                       f'{escape(e["name"][-int(w / 6):])}</text>')
    for e in waits:
        y = y_of.get(e["tid"], top)
        x = left + e["ts"] * scale
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + row - 4}" '
                   f'stroke="black" stroke-width="2"><title>{escape(e["name"])}</title></line>')
    out.append("</svg>")
    with open(dst, "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
