"""Merges a suite's parts into one result, plots it, and prints its table; or prints docs/results.md's tables.

    python -m benchmarks.report benchmarks/results/<device> [--profile full]
    python -m benchmarks.report benchmarks/results/<device> --markdown [--commit FILE=SHA ...]

On the GPU host each part of the suite (workloads a + c, then b and its decode-heavy variant dh, per model) runs
in its own device call and writes offload_<profile>_<part>.json; this writes offload_<profile>.json,
offload_<profile>.png and offload_<profile>.md (the table) beside them. --markdown writes nothing: it prints the
device's section of docs/results.md (the suite, workloads a and c, and engine_step.json's decode step when there),
every row naming its file, date and, from --commit, the commit it ran on.
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
        merged["b"] += [{**b, "part": os.path.basename(path)} for b in part.get("b", [])]
        for key in ("a", "c"):
            if key in part:
                merged[key] = part[key]
                merged.setdefault("sources", {})[key] = os.path.basename(path)
    if not merged["parts"]:
        raise SystemExit(f"no offload_{profile}_*.json parts in {out_dir}")
    return merged


def plot(result: dict, path: str) -> None:
    """Per workload, a column of two panels against the device KV budget: output tok/s (one line per placement,
    the budget-free ones flat), and below it auto/gpu and auto/ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = result.get("b", [])
    columns = max(1, len(specs))
    fig, axes = plt.subplots(2, columns, figsize=(6 * columns, 8), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": (3, 2)})
    for rates, ratios, b in zip(axes[0], axes[1], specs):
        _plot_rates(rates, b)
        _plot_ratios(ratios, b)
    fig.suptitle(f"{result['device']} ({result['host_cores']} host cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_rates(ax, b: dict) -> None:
    for placement in ("gpu", "auto"):
        points = sorted((r["device_pool_gib"], r["output_tok_per_s"]) for r in b["runs"]
                        if r["placement"] == placement and "output_tok_per_s" in r)
        if points:
            ax.plot(*zip(*points), marker="o", label=f"offload-engine {placement}")
    ideal = sorted((_budget_gib(b, int(budget)), rate) for budget, rate in b.get("ideal_tok_per_s", {}).items())
    if ideal:
        ax.plot(*zip(*ideal), marker="x", linestyle=":", color="tab:purple", label="ideal: gpu + host tier capacity")
    flat = [("offload-engine cpu (no device KV)", "tab:green", "-.",  # name, color, line style, rate
             next((r.get("output_tok_per_s") for r in b["runs"] if r["placement"] == "cpu"), None))]
    for label, peer in b["peers"].items():
        dynamic = "dynamic" in label  # transformers' dynamic cache has no budget: it uses the whole GPU
        flat.append((f"transformers, {label[3:]} cache" + (" (whole GPU)" if dynamic else ""),
                     "gray" if dynamic else "black", "--", peer.get("output_tok_per_s")))
    for label, color, style, rate in flat:
        if rate:
            ax.axhline(rate, linestyle=style, color=color, label=label)
    ax.set(title=f"{_title(b)}, KV {b.get('batch_kv_gib', 0):.3g} GiB", ylabel="output tok/s", xscale="log",
           yscale="log")
    ax.legend(fontsize=7)


def _plot_ratios(ax, b: dict) -> None:
    for other, color in (("gpu", "tab:orange"), ("ideal", "tab:purple")):
        points = sorted((_budget_gib(b, int(key.rsplit("@", 1)[1])), ratio) for key, ratio in b["ratios"].items()
                        if key.startswith(f"auto/{other}@"))
        if points:
            ax.plot(*zip(*points), marker="o", color=color, label=f"auto / {other}")
            for x, y in points:
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(xlabel="device KV budget (GiB)", ylabel="auto's ratio", xscale="log")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def _budget_gib(b: dict, budget: int) -> float:
    """The device pool, in GiB, of the runs at a budget in blocks."""
    return next(r["device_pool_gib"] for r in b["runs"] if r["budget_blocks"] == budget and "device_pool_gib" in r)


def _title(b: dict) -> str:
    spec = b["spec"]
    return (f"{spec.get('name', 'b')}. {spec['model']}, {spec['num_seqs']} x ({spec['prompt_len']} + "
            f"{spec['output_len']})")


def headline(result: dict) -> str:
    """A markdown table of every measured rate and the ratios the product claims."""
    dates = sorted({p["date"] for p in result.get("parts", [])}) or [result.get("date", "?")]
    lines = [(f"Measured {' to '.join(dict.fromkeys((dates[0], dates[-1])))} on {result['device']} ({result['host_cores']} host cores), "
              f"torch {result['torch']}; output tok/s. b is prompt-heavy, dh decode-heavy; ideal = gpu + the host "
              "tier's capacity (host read GB/s / KV bytes per token-step of a host row)."), "",
             "| workload | budget: GiB of device KV (share of the batch's) | gpu | auto | cpu | ideal | auto/gpu | "
             "auto/ideal | auto/HF offloaded | auto: promoted / demoted / preempted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b in result.get("b", []):
        name = _title(b)
        cpu = next((r.get("output_tok_per_s") for r in b["runs"] if r["placement"] == "cpu"), None)
        offloaded = b["peers"].get("hf_offloaded", {}).get("output_tok_per_s")
        for budget in sorted({r["budget_blocks"] for r in b["runs"] if r["placement"] == "gpu"}, reverse=True):
            at = {r["placement"]: r for r in b["runs"] if r["budget_blocks"] == budget}
            gpu, auto = (at.get(p, {}).get("output_tok_per_s") for p in ("gpu", "auto"))
            ideal = b.get("ideal_tok_per_s", {}).get(str(budget))
            run = at.get("gpu", at.get("auto", {}))
            moves = " / ".join(str(at.get("auto", {}).get(k, "-")) for k in ("promotions", "demotions", "preemptions"))
            lines.append(f"| {name} | {run.get('device_pool_gib', 0):.2f} ({run.get('budget_fraction', 0):.3g}) | "
                         f"{_n(gpu)} | {_n(auto)} | {_n(cpu)} | {_n(ideal)} | {_r(auto, gpu)} | {_r(auto, ideal)} | "
                         f"{_r(auto, offloaded)} | {moves} |")
        if b["peers"]:
            peers = ", ".join(f"{label[3:]} {_n(p.get('output_tok_per_s'))}" for label, p in b["peers"].items())
            lines.append(f"| {name}: transformers generate | | | | | | | | {peers} | |")
    lines.append("")
    if "a" in result:
        a = result["a"]
        lines.append(f"- a. {a['model']}, {a['num_seqs']} sequences, prompt and output lengths uniform in "
                     f"{list(a['range'])}, whole GPU: **{_n(a['output_tok_per_s'])} output tok/s**.")
    if "c" in result:
        c = result["c"]
        if "runs" not in c:  # before sequences were split (issue 11): wholly on the host tier
            lines.append(f"- c. {c['model']}, one {c['context']:,}-token context, {c['device_pool_gib']:.2f} GiB "
                         f"device budget: decode **{c['decode_tok_per_s']:.2f} tok/s = {c['fraction_of_bound']:.2f} of the "
                         f"host-read bound** ({c['bound_tok_per_s']:.2f} tok/s at {c['host_read_gbps']:.0f} GB/s).")
        else:
            lines.append(f"- c. {c['model']}, one sequence on a {c['budget_tokens']:,}-token device budget (host reads "
                         f"{c['host_read_gbps']:.0f} GB/s, HBM {c['hbm_gbps']:.0f} GB/s):")
            lines.append("")
            lines += ["  " + line for line in _c_table(c)]
    return "\n".join(lines)


def _c_table(c: dict) -> list[str]:
    """Workload c's runs: the split sequence, and the same wholly on each tier, against their bounds."""
    lines = ["| context | KV placement | device + host tokens | decode tok/s | bound | of bound | prefill tok/s | "
             "prefill / device only |", "|---|---|---|---|---|---|---|---|"]
    device_only = {run["context"]: run["prefill_tok_per_s"] for run in c["runs"].values() if run["placement"] == "gpu"}
    for run in c["runs"].values():
        where = {"auto": "split", "cpu": "host only", "gpu": "device only"}[run["placement"]]
        reference = device_only.get(run["context"])
        of_device = f"{run['prefill_tok_per_s'] / reference:.2f}" if reference else "-"
        lines.append(f"| {run['context']:,} | {where} | {run['kv_device_tokens']:,} + {run['kv_host_tokens']:,} | "
                     f"{run['decode_tok_per_s']:.2f} | {run['bound_tok_per_s']:.2f} | "
                     f"**{run['fraction_of_bound']:.2f}** | {run['prefill_tok_per_s']:,.0f} | {of_device} |")
    return lines


def results_md(out_dir: str, profile: str = "full", commits: dict[str, str] | None = None) -> str:
    """One device's tables for docs/results.md, from the JSON in out_dir: the suite's b and dh rows, workloads a
    and c, and the decode step of engine_step.json when it is there. Each row or table names its file, the date
    the file records and the commit from `commits` (file name -> commit; "?" where not given)."""
    commits = commits or {}
    result = merge(out_dir, profile)
    dates = {p["file"]: p["date"] for p in result["parts"]}

    def source(name: str, date: str | None = None) -> str:
        return f"`{name}` ({date or dates.get(name, '?')}, {commits.get(name, '?')})"

    lines = []
    if result["b"]:
        lines += [f"Output tok/s of `bench_throughput.py --profile {profile}` on {result['device']} "
                  f"({result['host_cores']} host cores, torch {result['torch']}). b is prompt-heavy, dh decode-heavy; "
                  "ideal = gpu + the host tier's capacity (host read GB/s / KV bytes per token-step of a host row); "
                  "transformers: its `generate` with the offloaded / dynamic cache (the dynamic one has the whole "
                  "GPU).", "",
                  "| workload | device KV budget, GiB (share of the batch's) | gpu | auto | auto/gpu | ideal | "
                  "auto/ideal | cpu | transformers | file (date, commit) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    for b in result["b"]:
        cpu = next((r.get("output_tok_per_s") for r in b["runs"] if r["placement"] == "cpu"), None)
        peers = " / ".join(_n(b["peers"].get(k, {}).get("output_tok_per_s")) for k in ("hf_offloaded", "hf_dynamic"))
        for i, budget in enumerate(sorted({r["budget_blocks"] for r in b["runs"] if r["placement"] == "gpu"},
                                          reverse=True)):
            at = {r["placement"]: r for r in b["runs"] if r["budget_blocks"] == budget}
            gpu, auto = (at.get(p, {}).get("output_tok_per_s") for p in ("gpu", "auto"))
            ideal = b.get("ideal_tok_per_s", {}).get(str(budget))
            run = at.get("gpu", at.get("auto", {}))
            first = i == 0
            lines.append(f"| {_title(b) if first else ''} | {run.get('device_pool_gib', 0):.2f} "
                         f"({_share(run.get('budget_fraction'))}) | {_n(gpu)} | {_n(auto)} | **{_r(auto, gpu)}** | "
                         f"{_n(ideal)} | {_r(auto, ideal).rstrip('x')} | {_n(cpu) if first else ''} | "
                         f"{peers if first and b['peers'] else ''} | {source(b['part'])} |")
    sources = result.get("sources", {})
    if "a" in result:
        a = result["a"]
        lines += ["", f"a. {a['model']}, {a['num_seqs']} sequences, prompt and output lengths uniform in "
                      f"{list(a['range'])}, whole GPU (nano-vllm's protocol): **{_n(a['output_tok_per_s'])} output "
                      f"tok/s**; {source(sources['a'])}."]
    if "c" in result and "runs" in result["c"]:
        c = result["c"]
        lines += ["", f"c. {c['model']}, one sequence longer than a {c['budget_tokens']:,}-token device budget: split "
                      "across the tiers, and the same wholly on each tier; the bound is the slower of its parts' reads "
                      f"(host {c['host_read_gbps']:.0f} GB/s, HBM {c['hbm_gbps']:.0f} GB/s); {source(sources['c'])}.",
                  ""] + _c_table(c)
    step_path = os.path.join(out_dir, "engine_step.json")
    if os.path.isfile(step_path):
        with open(step_path) as f:
            step = json.load(f)
        lines += ["", *_step_table(step, source("engine_step.json", step.get("date")))]
    return "\n".join(lines).strip("\n")


def _step_table(step: dict, source: str) -> list[str]:
    """bench_engine_step.py's grid: per batch and context, wall / graph replay and graph / HBM bound."""
    contexts = sorted({row["context"] for row in step["steps"]})
    by = {(row["batch"], row["context"]): row for row in step["steps"]}
    lines = [f"Decode step of the {step['model']} shape under `gpu` (`bench_engine_step.py`; {source}): the step's "
             "wall time over its CUDA graph's GPU time, and that GPU time over the HBM bound (weights once + the "
             f"batch's KV, at {step['hbm_gbps']:,.0f} GB/s).", "",
             "| batch | " + " | ".join(f"context {c:,}: wall / graph, graph / bound" for c in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    for batch in sorted({row["batch"] for row in step["steps"]}):
        cells = [f"{by[batch, c]['wall_over_gpu']:.2f}x, {by[batch, c]['gpu_over_bound']:.2f}x" if (batch, c) in by
                 else "-" for c in contexts]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    t = step.get("throughput")
    if t:
        lines += ["", f"{t['num_prompts']} prompts of lengths uniform in {t['prompt_range']}, {t['output_len']} greedy "
                      f"tokens each: **{_n(t['tok_s'])} output tok/s = {t['of_bound']:.2f} of the HBM bound** "
                      f"({_n(t['bound_tok_s'])}); async scheduling off {_n(t.get('tok_s_async_off'))}; transformers "
                      f"`generate_batch` {_n(t.get('hf_cb_tok_s'))}"
                      + (f"; workload a {_n(step['a']['output_tok_per_s'])}" if "a" in step else "") + "."]
    return lines


def _share(fraction) -> str:
    """A budget's share of the batch's KV: 1/4 where it is one, else two digits."""
    if not fraction:
        return "-"
    whole = round(1 / fraction)
    return f"1/{whole}" if abs(1 / fraction - whole) < 1e-6 else f"{fraction:.2f}"


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
    parser.add_argument("--markdown", action="store_true", help="print docs/results.md's tables for this folder")
    parser.add_argument("--commit", action="append", default=[], metavar="FILE=SHA",
                        help="with --markdown: the commit a file's run measured (repeatable)")
    args = parser.parse_args()
    if args.markdown:
        bad = [c for c in args.commit if "=" not in c]
        if bad:
            parser.error(f"--commit takes FILE=SHA, got {bad[0]!r}")
        print(results_md(args.out_dir, args.profile, dict(c.split("=", 1) for c in args.commit)))
        return
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
