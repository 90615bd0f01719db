"""The `offload-engine` command: `demo` (the embedded tiny model), `generate` (a model directory), `bench` (the suite).

A mistake the user can fix (a bad flag, a missing model directory, an unsupported architecture, a corrupt weights
file, a bad sampling value) ends in one `offload-engine: error: ...` line and exit status 2; Ctrl-C in one
`offload-engine: interrupted` line and exit status 130; a traceback means a bug in the engine. The demo exits 1 when
its greedy check against transformers fails. Nothing heavy (torch, transformers, numba) is imported until the
arguments are parsed, so `--help` and a bad flag answer at once.
"""
import argparse
import os
import sys
from pathlib import Path

# offload_engine.config.KV_PLACEMENTS, written out so that parsing need not import torch (tests/test_cli.py checks
# that the two agree).
KV_PLACEMENTS = ("gpu", "cpu", "auto")
KV_WORDS = {"gpu": "device tier", "cpu": "host tier", "split": "split across the tiers"}  # kv_location, in words
INTERRUPTED_STATUS = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported like every other user error: one line, exit status 2."""

    def error(self, message: str):
        _fail(f"{message} (see `{self.prog} --help`)")


def main(argv: list[str] | None = None) -> None:
    try:
        failed = _run(_parse(argv))
    except (ValueError, OSError) as err:  # what the engine's public API raises for input the user can change
        _fail(" ".join(str(err).splitlines()))
    except KeyboardInterrupt:
        print("offload-engine: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_STATUS)
    if failed:
        sys.exit(1)


def _fail(message: str):
    print(f"offload-engine: error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="offload-engine", description=__doc__)
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
    return parser.parse_args(argv)


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
    import subprocess

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "bench_throughput.py").is_file():
        raise OSError(f"offload-engine bench runs the suite of a source checkout, and {root / 'benchmarks'} has none: "
                      "clone the repository and install it with `pip install -e .` (or run `make bench` there)")
    command = [sys.executable, "-m", "benchmarks.bench_throughput", "suite", "--profile", args.profile,
               "--workloads", args.workloads, *(["--out-dir", str(Path(args.out_dir).resolve())] if args.out_dir else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, env=env).returncode != 0


def _generate(args) -> None:
    import dataclasses
    import json

    from offload_engine import LLM, SamplingParams

    # Sampling values first: a bad --temperature should not wait for the weights to load.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    with LLM(args.model, device=args.device, dtype=args.dtype, kv_placement=args.kv_placement,
             max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks,
             cpu_kv_cache_gb=args.cpu_kv_cache_gb) as llm:
        outputs = llm.generate(args.prompt, params)
    for output in outputs:
        if args.json:  # vLLM's fields, and the first completion's text, token_ids and finish_reason at the top
            print(json.dumps({**dataclasses.asdict(output), "text": output.text, "token_ids": output.token_ids,
                              "finish_reason": output.finish_reason}))
        else:
            print(f"--- {output.prompt!r} [{output.finish_reason}, KV: {KV_WORDS[output.kv_location]}]\n{output.text}")


if __name__ == "__main__":
    main()
