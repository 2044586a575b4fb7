"""Results on disk: results.json, results.csv and PNG plots."""

import csv
import json
import os


def write_results(rows: list, meta: dict, out: str) -> list:
    """results.json, results.csv and PNG plots (with matplotlib, headless Agg backend) in
    ``out``; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    written = [os.path.join(out, "results.json"), os.path.join(out, "results.csv")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: plots skipped (pip install matplotlib, or pip install -e \".[test]\")")
        return written
    timed = [r for r in rows if r["time_s"]]
    if len({r["T"] for r in timed}) > 1:  # a sweep: each path against T
        written += _plot_sweep(plt, timed, meta, out)
    return written + _plot_bars(plt, timed, meta, out)


def _plot_sweep(plt, timed: list, meta: dict, out: str) -> list:
    """time_vs_T.png and memory_vs_T.png: each path against T (log-log)."""
    written = []
    series = sorted({(r["name"], r["kind"]) for r in timed})
    for metric, fname, ylabel in (("time_s", "time_vs_T.png", "seconds"),
                                  ("peak_bytes", "memory_vs_T.png", "peak bytes")):
        fig, ax = plt.subplots(figsize=(7, 5))
        for name, kind in series:
            pts = [(r["T"], r[metric]) for r in timed if r["name"] == name and r["kind"] == kind and r[metric]]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=f"{name} {kind}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel(ylabel)
        ax.set_title(f"KDA {ylabel} vs T (H=8, K=V=128) — {meta['machine']}", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        written.append(os.path.join(out, fname))
        plt.close(fig)
    return written


def _plot_bars(plt, timed: list, meta: dict, out: str) -> list:
    """time_fwd.png and time_fwd_bwd.png: a bar per path at the largest T."""
    written = []
    for kind, fname in (("fwd", "time_fwd.png"), ("fwd+bwd", "time_fwd_bwd.png")):
        bars = [r for r in timed if r["kind"] == kind and r["T"] == max(x["T"] for x in timed)]
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(bars) + 1.5))
        ax.barh([r["name"] for r in bars], [1e3 * r["time_s"] for r in bars],
                color=["tab:blue" if r["name"].startswith("chunk_kda") else "tab:gray" for r in bars])
        for i, r in enumerate(bars):
            ax.text(1e3 * r["time_s"], i, f" {1e3 * r['time_s']:.0f} ms", va="center", fontsize=8)
        ax.set_xlabel("ms (median; linear scale)")
        ax.set_title(f"KDA {kind}, T={bars[0]['T']} — {meta['machine']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        written.append(os.path.join(out, fname))
        plt.close(fig)
    return written
