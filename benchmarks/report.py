"""Merges a suite's parts into one result, plots it, and prints the README's headline table.

    python -m benchmarks.report benchmarks/results/nvidia-h200 [--profile full]

On the GPU host each part of the suite (workload a + c, then b per model) runs in its own device call and
writes offload_<profile>_<part>.json; this writes offload_<profile>.json, offload_<profile>.png and
offload_<profile>.md (the headline table) beside them.
"""
import argparse
import glob
import json
import os
import time


def merge(out_dir: str, profile: str) -> dict:
    merged: dict = {"b": [], "parts": []}
    for path in sorted(glob.glob(os.path.join(out_dir, f"offload_{profile}_*.json"))):
        with open(path) as f:
            part = json.load(f)
        merged["parts"].append({"file": os.path.basename(path), "host_read_gbps": part["host_read_gbps"],
                                "date": part.get("date", _modified(path))})
        for key in ("profile", "device", "host_cores", "platform", "torch"):
            merged.setdefault(key, part[key])
        merged["b"] += part.get("b", [])
        for key in ("a", "c"):
            if key in part:
                merged[key] = part[key]
    if not merged["parts"]:
        raise SystemExit(f"no offload_{profile}_*.json parts in {out_dir}")
    return merged


def plot(result: dict, path: str) -> None:
    """Output tok/s against the device KV budget: one line per placement, the budget-free ones flat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = result.get("b", [])
    fig, axes = plt.subplots(1, max(1, len(specs)), figsize=(6 * max(1, len(specs)), 4.5), squeeze=False)
    for ax, b in zip(axes[0], specs):
        for placement in ("gpu", "auto"):
            points = sorted((r["device_pool_gib"], r["output_tok_per_s"]) for r in b["runs"]
                            if r["placement"] == placement and "output_tok_per_s" in r)
            if points:
                ax.plot(*zip(*points), marker="o", label=f"offload-engine {placement}")
        flat = [("offload-engine cpu (no device KV)", "tab:green", "-.",  # name, color, line style, rate
                 next((r.get("output_tok_per_s") for r in b["runs"] if r["placement"] == "cpu"), None))]
        for label, peer in b["peers"].items():
            dynamic = "dynamic" in label  # transformers' dynamic cache has no budget: it uses the whole GPU
            flat.append((f"transformers, {label[3:]} cache" + (" (whole GPU)" if dynamic else ""),
                         "gray" if dynamic else "black", "--", peer.get("output_tok_per_s")))
        for label, color, style, rate in flat:
            if rate:
                ax.axhline(rate, linestyle=style, color=color, label=label)
        spec = b["spec"]
        ax.set(title=f"{spec['model']}: {spec['num_seqs']} x ({spec['prompt_len']} + {spec['output_len']}), "
                     f"KV {b.get('batch_kv_gib', 0):.1f} GiB",
               xlabel="device KV budget (GiB)", ylabel="output tok/s", xscale="log", yscale="log")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['device']} ({result['host_cores']} host cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def headline(result: dict) -> str:
    """A markdown table of every measured rate and the ratios the product claims."""
    dates = sorted({p["date"] for p in result.get("parts", [])}) or [result.get("date", "?")]
    lines = [(f"Measured {' to '.join(dict.fromkeys((dates[0], dates[-1])))} on {result['device']} ({result['host_cores']} host cores), "
              f"torch {result['torch']}; output tok/s."), "",
             "| workload | budget (GiB of device KV) | gpu | auto | cpu | auto/gpu | auto/HF offloaded |",
             "|---|---|---|---|---|---|---|"]
    for b in result.get("b", []):
        spec = b["spec"]
        name = f"b. {spec['model']}, {spec['num_seqs']} x ({spec['prompt_len']} + {spec['output_len']})"
        cpu = next((r.get("output_tok_per_s") for r in b["runs"] if r["placement"] == "cpu"), None)
        offloaded = b["peers"].get("hf_offloaded", {}).get("output_tok_per_s")
        for budget in sorted({r["budget_blocks"] for r in b["runs"] if r["placement"] == "gpu"}, reverse=True):
            at = {r["placement"]: r for r in b["runs"] if r["budget_blocks"] == budget}
            gpu, auto = (at.get(p, {}).get("output_tok_per_s") for p in ("gpu", "auto"))
            gib = at.get("gpu", at.get("auto", {})).get("device_pool_gib", 0)
            lines.append(f"| {name} | {gib:.2f} | {_n(gpu)} | {_n(auto)} | {_n(cpu)} | {_r(auto, gpu)} | "
                         f"{_r(auto, offloaded)} |")
        peers = ", ".join(f"{label[3:]} {_n(p.get('output_tok_per_s'))}" for label, p in b["peers"].items())
        lines.append(f"| {name}: transformers generate | | | | | | {peers} |")
    lines.append("")
    if "a" in result:
        a = result["a"]
        lines.append(f"- a. {a['model']}, {a['num_seqs']} sequences, prompt and output lengths uniform in "
                     f"{list(a['range'])}, whole GPU: **{_n(a['output_tok_per_s'])} output tok/s**.")
    if "c" in result:
        c = result["c"]
        lines.append(f"- c. {c['model']}, one {c['context']:,}-token context, {c['device_pool_gib']:.2f} GiB device "
                     f"budget: decode **{c['decode_tok_per_s']:.2f} tok/s = {c['fraction_of_bound']:.2f} of the "
                     f"host-read bound** ({c['bound_tok_per_s']:.2f} tok/s at {c['host_read_gbps']:.0f}"
                     " GB/s).")
    return "\n".join(lines)


def _modified(path: str) -> str:
    """The date a part was written, for parts from before results carried their own."""
    return time.strftime("%Y-%m-%d", time.localtime(os.path.getmtime(path)))


def _n(rate) -> str:
    return f"{rate:,.0f}" if rate else "-"


def _r(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--profile", default="full")
    args = parser.parse_args()
    result = merge(args.out_dir, args.profile)
    name = os.path.join(args.out_dir, f"offload_{args.profile}")
    with open(name + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(result, name + ".png")
    table = headline(result)
    with open(name + ".md", "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
