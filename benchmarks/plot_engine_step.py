"""Plots engine_step.json (bench_engine_step.py): per batch, a decode step's wall time over its graph's GPU time,
and the graph's time over the HBM bound, one line per context length; with a second file (an earlier run on the
same device kind), its lines dashed for comparison.

    PYTHONPATH=. python benchmarks/plot_engine_step.py RESULTS/engine_step.json [EARLIER.json] [--out PNG]
"""
import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result")
    parser.add_argument("earlier", nargs="?")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(args.result, "-")] + ([(args.earlier, "--")] if args.earlier else [])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path, style in runs:
        with open(path) as f:
            result = json.load(f)
        label = f"{result['date']}" + (" (earlier)" if style == "--" else "")
        for context in sorted({row["context"] for row in result["steps"]}):
            rows = sorted((r for r in result["steps"] if r["context"] == context), key=lambda r: r["batch"])
            batches = [r["batch"] for r in rows]
            axes[0].plot(batches, [r["wall_over_gpu"] for r in rows], style, marker="o", label=f"{label}, ctx {context}")
            axes[1].plot(batches, [r["gpu_over_bound"] for r in rows], style, marker="o", label=f"{label}, ctx {context}")
    axes[0].axhline(1.05, color="grey", lw=0.8)
    axes[0].set(xscale="log", xlabel="batch", ylabel="step wall / graph GPU time", title="host overhead per step")
    axes[1].set(xscale="log", yscale="log", xlabel="batch", ylabel="graph time / HBM bound", title="the graph itself")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    out = args.out or os.path.join(os.path.dirname(args.result), "engine_step.png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
