"""Markdown tables and speedup plots from benchmark JSON files.

``python -m fastla.bench.report FILE.json [FILE.json ...] [--output STEM] [--readme README.md]``
merges the records of the files, writes ``STEM.md`` and ``STEM.png`` (default stem: the
first file's path without ``.json``, plus ``-merged`` when several are given), prints the
table, and optionally replaces the block between ``<!-- bench:start -->`` and
``<!-- bench:end -->`` in a README. The plot needs matplotlib and is skipped without it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

README_START = "<!-- bench:start -->"
README_END = "<!-- bench:end -->"

COLUMNS = (
    "op", "config", "mode", "fastla ms (graph / eager)", "FLA ms (graph / eager)", "speedup",
    "TFLOP/s", "GB/s", "rel err fastla / FLA", "cold s",
)

Record = dict


def load_records(paths: Iterable[str | Path]) -> list[Record]:
    """The records of the given result files, in file order; a later file's record replaces an
    earlier one of the same config and mode (re-runs supersede)."""
    latest: dict[tuple, Record] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for rec in data.get("records", []):
            latest[(rec.get("config"), rec.get("mode"))] = rec
    return list(latest.values())


def _number(x: object) -> float | None:
    """A record value as a float: None stays None, "nan"/"inf" strings become floats."""
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _ms(x: object) -> str:
    v = _number(x)
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}"


def _sci(x: object) -> str:
    v = _number(x)
    if v is None:
        return "-"
    return "nan" if math.isnan(v) else f"{v:.1e}"


def _fixed(x: object, digits: int) -> str:
    v = _number(x)
    return "-" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def _pair(a: str, b: str) -> str:
    return "-" if a == "-" and b == "-" else f"{a} / {b}"


def _speedup(rec: Record) -> str:
    ratio = _number(rec.get("ratio"))
    if ratio is not None:
        return f"**{ratio:.2f}x**" if ratio >= 1 else f"{ratio:.2f}x"
    if rec.get("ratio_note"):
        return "refused"
    return "-"


def _fla_cell(rec: Record) -> str:
    cell = _pair(_ms(rec.get("fla_ms_graph")), _ms(rec.get("fla_ms_eager")))
    return f"{cell} \u2020" if rec.get("fla_note") and cell != "-" else cell


def _row(rec: Record) -> list[str]:
    return [
        str(rec.get("op", "")),
        f"`{rec.get('config', '')}`",
        str(rec.get("mode", "")),
        _pair(_ms(rec.get("fastla_ms_graph")), _ms(rec.get("fastla_ms_eager"))),
        _fla_cell(rec),
        _speedup(rec),
        _fixed(rec.get("tflops"), 1),
        _fixed(rec.get("gbps"), 0),
        _pair(_sci(rec.get("fastla_rel_err")), _sci(rec.get("fla_rel_err"))),
        _fixed(rec.get("cold_s"), 1),
    ]


def _header(records: Sequence[Record]) -> list[str]:
    """The stack, each value listed once (several runs may be merged into one table)."""
    parts = []
    for key in ("gpu", "torch", "triton", "fla", "commit"):
        values = list(dict.fromkeys(str(r[key]) for r in records if r.get(key) not in (None, "unknown")))
        if values:
            parts.append(f"{key} {', '.join(values)}")
    return [f"Measured on {'; '.join(parts)}." if parts else "", ""]


def _notes(records: Sequence[Record]) -> list[str]:
    lines = []
    fla_notes = sorted({str(r["fla_note"]) for r in records if r.get("fla_note")})
    for note in fla_notes:
        lines.append(f"\u2020 FLA: {note}.")
    refused = [r for r in records if r.get("ratio") is None and r.get("ratio_note")]
    for r in refused:
        lines.append(f"- `{r.get('config')}` {r.get('mode')}: speedup refused ({r['ratio_note']}).")
    for r in records:
        problem = r.get("error") or r.get("fastla_error")
        if problem:
            lines.append(f"- `{r.get('config')}` {r.get('mode')}: fastla failed ({problem}).")
    return [""] + lines if lines else []


def render_markdown(records: Sequence[Record]) -> str:
    """The results table (one row per record) with a header line and footnotes."""
    if not records:
        return "No benchmark records.\n"
    lines = _header(records)
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join("---" for _ in COLUMNS) + "|")
    lines += ["| " + " | ".join(_row(r)) + " |" for r in records]
    lines += _notes(records)
    lines += [
        "",
        "Speedup = FLA ms / fastla ms, both graph replay when both have it, else both eager; "
        "rel err = ||x - ref|| / ||ref|| of the output and final state against the float64 reference.",
    ]
    return "\n".join(lines).lstrip("\n") + "\n"


def plot_speedups(records: Sequence[Record], path: str | Path) -> bool:
    """A horizontal bar chart of the speedups to ``path`` (PNG); False when matplotlib is
    missing or no record has a speedup."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [(f"{r['config']} {r['mode']}", float(r["ratio"])) for r in records if _number(r.get("ratio")) is not None]
    if not rows:
        return False
    labels, ratios = zip(*rows)
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.2))
    colors = ["tab:green" if x >= 1 else "tab:red" for x in ratios]
    ax.barh(range(len(rows)), ratios, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over FLA 0.6.0 (FLA ms / fastla ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def update_readme_table(readme_path: str | Path, md: str) -> None:
    """Replace the text between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in
    ``readme_path`` with ``md``; raises ``ValueError`` when the markers are missing."""
    path = Path(readme_path)
    text = path.read_text()
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"{path} has no {README_START} ... {README_END} block")
    block = f"{README_START}\n{md.rstrip()}\n{README_END}"
    path.write_text(pattern.sub(lambda _: block, text, count=1))


def write_report(records: Sequence[Record], stem: str | Path) -> tuple[Path, Path | None]:
    """Write ``stem.md`` and (when possible) ``stem.png``; returns their paths."""
    stem = Path(stem)
    md_path = stem.with_name(stem.name + ".md")
    md_path.write_text(render_markdown(records))
    png_path = stem.with_name(stem.name + ".png")
    return md_path, png_path if plot_speedups(records, png_path) else None


def _default_stem(paths: Sequence[str]) -> Path:
    first = Path(paths[0])
    stem = first.with_suffix("") if first.suffix == ".json" else first
    return stem.with_name(stem.name + "-merged") if len(paths) > 1 else stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastla.bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="benchmark JSON files written by the runner")
    parser.add_argument("--output", help="output path without extension (default: next to the first file)")
    parser.add_argument("--readme", help="README whose bench:start/bench:end block gets the table")
    args = parser.parse_args(argv)
    records = load_records(args.files)
    stem = Path(args.output) if args.output else _default_stem(args.files)
    md_path, png_path = write_report(records, stem)
    md = md_path.read_text()
    print(md)
    print(f"wrote {md_path}", file=sys.stderr)
    print(f"wrote {png_path}" if png_path else "plot skipped (matplotlib not importable or no speedups)",
          file=sys.stderr)
    if args.readme:
        update_readme_table(args.readme, md)
        print(f"updated {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
