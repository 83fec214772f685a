"""``run.py`` several times, each in its own process, and each ratio's median over the runs.

One run's ratios move by 10-30% between runs minutes apart on the same lent GPU (the same
tree, the raw library timed beside ours in each): a row that is "met" on one run is missed
on the next. The median of a few whole runs, with their range beside it, is the number to
compare with a target. Each run's own output is kept in the output directory given.

    python benchmarks/runs.py 3 [--out DIR] [run.py options, e.g. --quick]
"""
import os
import re
import statistics
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROW = re.compile(r"^(?P<name>[^|]+?)\s*\|\s*(?P<ours>[\d.]+) us\s*\|[^|]*\|\s*(?P<ratio>[\d.]+)x\s*$")


def ratios(text: str) -> dict[str, float]:
    """Each ratio row of one ``run.py`` table: name -> ratio."""
    out = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            out.setdefault(m.group("name").strip(), float(m.group("ratio")))
    return out


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        print(__doc__)
        return 2
    n, rest = int(argv[0]), argv[1:]
    out_dir = None
    if "--out" in rest:
        i = rest.index("--out")
        out_dir = rest[i + 1]
        del rest[i:i + 2]
        os.makedirs(out_dir, exist_ok=True)
    runs = []
    for k in range(n):
        r = subprocess.run([sys.executable, os.path.join(_HERE, "run.py"), *rest],
                           capture_output=True, text=True)
        if out_dir is not None:
            with open(os.path.join(out_dir, f"run{k + 1}.log"), "w") as f:
                f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            print(f"run {k + 1} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
            return 1
        runs.append(ratios(r.stdout))
    names = [name for name in runs[0] if all(name in got for got in runs)]
    if not names:  # (the host backend's rows are absolute times: no ratios)
        print("no ratio rows in run.py's output (no GPU here?)")
        return 0
    width = max(len(name) for name in names)
    print(f"{'row':{width}s} | median | range over {n} runs")
    for name in names:
        vals = [got[name] for got in runs]
        print(f"{name:{width}s} | {statistics.median(vals):5.2f}x | "
              f"{min(vals):.2f}-{max(vals):.2f}x ({', '.join(f'{v:.2f}' for v in vals)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
