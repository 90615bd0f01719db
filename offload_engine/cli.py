"""The `offload-engine` command: `demo` (the embedded tiny model), `generate` (a real model directory) and
`bench` (the offload benchmark suite).

A mistake the user can fix (a missing model directory, an unsupported architecture, a bad sampling value) ends
in one `offload-engine: error: ...` line and exit status 2, as argparse does for a bad flag; a traceback means
a bug in the engine. The demo exits 1 when its greedy check against transformers fails.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from offload_engine.config import KV_PLACEMENTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="offload-engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run a batch of long prompts on the embedded tiny model")
    demo.add_argument("--requests", type=int, default=16)
    demo.add_argument("--prompt-len", type=int, default=1024)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--device", default=None)

    bench = commands.add_parser("bench", help="the offload benchmark suite (small profile: any machine)")
    bench.add_argument("--profile", default="small", choices=("small", "full"))
    bench.add_argument("--workloads", default="abc")
    bench.add_argument("--out-dir", default=None)

    gen = commands.add_parser("generate", help="generate text with a Hugging Face model directory")
    gen.add_argument("--model", required=True, help="directory with config.json, *.safetensors and a tokenizer")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--kv-placement", choices=KV_PLACEMENTS, default="auto")
    gen.add_argument("--device", default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--num-gpu-blocks", type=int, default=None)
    gen.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    args = parser.parse_args(argv)
    try:
        failed = _run(args)
    except (ValueError, OSError) as err:  # what the engine's public API raises for input the user can change
        print(f"{parser.prog}: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        sys.exit(2)
    if failed:
        sys.exit(1)


def _run(args) -> bool:
    """Runs the chosen command; True when it finished but its result says something is wrong."""
    if args.command == "demo":
        from offload_engine.demo import run_demo

        summary = run_demo(args.requests, args.prompt_len, args.max_tokens, args.device)
        return summary["greedy_matches"] != summary["greedy_requests"]
    if args.command == "bench":
        return _bench(args)
    _generate(args)
    return False


def _bench(args) -> bool:
    """Runs benchmarks/bench_throughput.py as its own program: it lives in the source checkout, not the package."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "bench_throughput.py").is_file():
        raise OSError(f"offload-engine bench runs the suite of a source checkout, and {root / 'benchmarks'} has none: "
                      "clone the repository and install it with `pip install -e .` (or run `make bench` there)")
    command = [sys.executable, "-m", "benchmarks.bench_throughput", "suite", "--profile", args.profile,
               "--workloads", args.workloads, *(["--out-dir", str(Path(args.out_dir).resolve())] if args.out_dir else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, env=env).returncode != 0


def _generate(args) -> None:
    from offload_engine import LLM, SamplingParams

    # Sampling values first: a bad --temperature should not wait for the weights to load.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    with LLM(args.model, device=args.device, dtype=args.dtype, kv_placement=args.kv_placement,
             max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks,
             cpu_kv_cache_gb=args.cpu_kv_cache_gb) as llm:
        outputs = llm.generate(args.prompt, params)
    for output in outputs:
        if args.json:
            print(json.dumps(vars(output)))
        else:
            print(f"--- {output.prompt!r} [{output.finish_reason}, KV on {output.kv_location}]\n{output.text}")


if __name__ == "__main__":
    main()
