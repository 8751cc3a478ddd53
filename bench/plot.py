"""Plot serving sweeps: output throughput, TTFT, ITL and TPOT p50 against concurrency.

    python bench/plot.py kiln_sweep.json mlx_lm_sweep.json --out sweep.png [--title "..."]

Each JSON is what `bench/serving.py` writes: a sweep document (its "label" names the line)
or a single level's result (a one-point line named by its URL). Several files are overlaid
in one figure of four panels. Uses matplotlib's Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _tpot_p50(result: dict[str, Any]) -> float:
    return result.get("tpot_ms", {}).get("p50", float("nan"))  # absent in older JSONs


# (panel title, y label, how to read the value from one level's result)
_PANELS: tuple[tuple[str, str, Any], ...] = (
    ("Output throughput", "output tokens/s", lambda r: r["output_tok_s"]),
    ("Time to first token (p50)", "ms", lambda r: r["ttft_ms"]["p50"]),
    ("Inter-token latency (p50)", "ms", lambda r: r["itl_ms"]["p50"]),
    ("Time per output token (p50)", "ms", _tpot_p50),
)


def load_sweep(path: Path) -> dict[str, Any]:
    """A sweep document from either JSON shape serving.py writes."""
    doc = json.loads(path.read_text())
    if "results" in doc:
        return doc
    return {"label": doc.get("url", path.stem), "results": [doc]}


def measured(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """The levels that ran, by concurrency (skipped levels carry no numbers)."""
    rows = [r for r in sweep["results"] if "skipped" not in r]
    return sorted(rows, key=lambda r: r["concurrency"])


def plot_sweeps(sweeps: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    levels = sorted({r["concurrency"] for s in sweeps for r in measured(s)})
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.5 * len(_PANELS), 4.2))
    for ax, (name, unit, value) in zip(axes, _PANELS):
        for sweep in sweeps:
            rows = measured(sweep)
            ax.plot([r["concurrency"] for r in rows], [value(r) for r in rows], marker="o",
                    label=sweep.get("label", "?"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)  # label the measured levels, not powers of two
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("sweeps", nargs="+", type=Path, help="JSON files written by serving.py")
    p.add_argument("--out", type=Path, default=Path("sweep.png"), help="PNG to write")
    p.add_argument("--title", default="", help="figure title")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(plot_sweeps([load_sweep(p) for p in args.sweeps], args.out, args.title))


if __name__ == "__main__":
    main()
