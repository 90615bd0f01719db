"""One long-context workload with an engine switch (an environment variable) at two values, in one process.

    python -m benchmarks.ab_long_context --workload batch8b --env OFFLOAD_ENGINE_PROMOTE_IN_PARTS --values 0,1 \\
        --rounds 2 --out ab.json

The platform's ceilings are measured once; then the values take turns (0, 1, 0, 1, ...), each run as
bench_long_context's entry runs (kv_placement="auto", streaming on), so drift of the host between runs falls on both
values alike. Written after every run: each run's figures (decode_tok_per_s, fraction_of_bound, promotions, ...),
and per value the median decode rate and fraction of the bound, with the second value's median over the first's. A
run is not started where less is left before --deadline-s than the longest run so far took.
"""
import argparse
import json
import os
import statistics
import time

from benchmarks.bench_long_context import WORKLOADS, Deadline, engine_run, log, ratio, summary
from benchmarks.bench_throughput import device_slug, model_dir

# Kept of each run; the decode steps' sum over median x steps is where promotions show (the device lane waits).
KEPT = ("decode_tok_per_s", "fraction_of_bound", "bound_tok_per_s", "streamed_share", "prefill_tok_per_s",
        "output_tok_per_s", "decode_steps", "decode_steps_seconds", "decode_step_ms_median", "promotions",
        "split_growths", "demotions", "preemptions", "decoded_by_lane", "steps_by_lane", "kv_location", "seconds",
        "prefill_seconds", "error")


def by_value(runs: list[dict], values: list[str]) -> dict:
    """Per value: its runs' median decode rate and fraction of the bound; and the last value's over the first's."""
    medians = {}
    for value in values:
        mine = [r for r in runs if r["value"] == value and r.get("decode_tok_per_s")]
        medians[value] = {key: statistics.median(r[key] for r in mine) if mine and all(r.get(key) for r in mine)
                          else None for key in ("decode_tok_per_s", "fraction_of_bound")}
        medians[value]["runs"] = len(mine)
    first, last = medians[values[0]], medians[values[-1]]
    return {"medians": medians, "last_over_first": ratio(last["decode_tok_per_s"], first["decode_tok_per_s"])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--env", required=True, help="the environment variable the engine reads, e.g. "
                        "OFFLOAD_ENGINE_PROMOTE_IN_PARTS")
    parser.add_argument("--values", default="0,1", help="comma-separated values, taken in turn")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each value")
    parser.add_argument("--out", required=True, help="the JSON written after every run")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="the process's wall-clock budget")
    parser.add_argument("--model-cache", default="/tmp/offload_engine_models")
    args = parser.parse_args(argv)
    values = args.values.split(",")
    if len(values) < 2 or args.rounds < 1:
        raise ValueError(f"--values {args.values!r} --rounds {args.rounds}: give two values or more and one round "
                         "or more, e.g. --values 0,1 --rounds 2")
    from benchmarks.platform_ceilings import measure_ceilings

    spec, deadline = WORKLOADS[args.workload], Deadline(args.deadline_s)
    ceilings = measure_ceilings(**spec.ceilings)
    path = model_dir(spec.model, args.model_cache)
    result = {"workload": spec.name, "device": device_slug(), "date": time.strftime("%Y-%m-%d"),
              "commit": os.environ.get("BENCH_COMMIT"), "env": args.env, "values": values, "ceilings": ceilings,
              "runs": [], "not_run": []}
    before, longest = os.environ.get(args.env), 0.0
    try:
        for round_ in range(args.rounds):
            for value in values:
                if deadline.left() < 1.2 * longest:
                    result["not_run"].append({"round": round_, "value": value, "left_s": deadline.left()})
                    continue
                os.environ[args.env] = value
                run = engine_run(spec, path, "auto", True, ceilings)
                longest = max(longest, run["wall_seconds"])
                log(summary(spec, f"{args.env}={value}", run) + f" promotions {run.get('promotions')}")
                result["runs"].append({"round": round_, "value": value, **{k: run.get(k) for k in KEPT}})
                result.update(by_value(result["runs"], values))
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=2, default=str)
    finally:
        if before is None:
            os.environ.pop(args.env, None)
        else:
            os.environ[args.env] = before
    log(f"[{spec.name}] {args.env}: {json.dumps(result.get('medians'))}, last over first "
        f"{result.get('last_over_first')}")
    return result


if __name__ == "__main__":
    main()
