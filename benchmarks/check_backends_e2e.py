"""End to end on the GPU: the Triton backend against the torch path on a Qwen3-0.6B-shaped random bf16 model.

Compares the first step's logits (relative error, within bf16 tolerance) and the greedy tokens of every
sequence, counting agreement only up to the first step where the torch path's top-2 margin is unclear. The
reference runs eagerly so that every step's margins are known; the runs under test use CUDA graphs.
Also runs the same prompts with kv_placement "cpu" and "auto" (a small device pool) to cover the host tier.
"""
import argparse
import gc
import json

import torch

from benchmarks.random_model import materialize
from offload_engine import LLM, SamplingParams

CLEAR_MARGIN = 0.05  # logits of random weights are close; below this gap bf16 rounding may flip the argmax


def first_logits_and_tokens(path: str, prompts, max_tokens: int, **kwargs):
    llm = LLM(path, max_model_len=4096, gpu_memory_utilization=0.3, **kwargs)
    captured = []
    compute_logits = llm.engine.runner.model.compute_logits

    def capture(hidden):
        logits = compute_logits(hidden)
        captured.append(logits.float().cpu())
        return logits

    llm.engine.runner.model.compute_logits = capture
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    summary = llm.kv_cache_summary
    llm.close()
    del llm, capture, compute_logits
    gc.collect()  # the capture closure and the model reference each other
    torch.cuda.empty_cache()
    return captured, [o.token_ids for o in outputs], [o.kv_location for o in outputs], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default="/tmp/offload_engine_models")
    parser.add_argument("--out", default="benchmarks/results/check_backends_e2e.json")
    args = parser.parse_args()
    path = materialize("qwen3-0.6b", args.model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (1, 17, 200, 700, 1500, 64, 333, 16)]
    # The reference runs eagerly so every step's logits (and so every step's top-2 margin) are seen.
    ref_logits, ref_tokens, _, _ = first_logits_and_tokens(path, prompts, 16, attention_backend="torch",
                                                           kv_placement="gpu", enforce_eager=True)
    report = {}
    for name, kwargs in {
        "triton/gpu": dict(attention_backend="triton", kv_placement="gpu"),
        "triton/cpu": dict(attention_backend="triton", kv_placement="cpu", cpu_kv_cache_gb=4),
        "triton/auto": dict(attention_backend="triton", kv_placement="auto", num_gpu_blocks=100, cpu_kv_cache_gb=4),
    }.items():
        logits, tokens, where, summary = first_logits_and_tokens(path, prompts, 16, **kwargs)
        rel = ((logits[0] - ref_logits[0]).norm() / ref_logits[0].norm()).item()
        agree, compared = 0, 0
        for step_logits_ref, seq_tokens, seq_ref in _per_sequence(ref_logits, tokens, ref_tokens):
            for margin, a, b in zip(step_logits_ref, seq_tokens, seq_ref):
                if margin < CLEAR_MARGIN:
                    break
                compared += 1
                agree += a == b
                if a != b:
                    break
        report[name] = {"first_step_logits_rel_err": rel, "tokens_compared": compared, "tokens_agree": agree,
                        "sequences_identical": sum(a == b for a, b in zip(tokens, ref_tokens)),
                        "kv_location": where, **summary}
        same = report[name]["sequences_identical"]
        print(f"{name:12s} rel err {rel:.2e}   greedy tokens agree {agree}/{compared} (clear margins), "
              f"{same}/{len(tokens)} sequences identical over 16 tokens   KV {where}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


def _per_sequence(ref_logits, tokens, ref_tokens):
    """For each sequence, the torch path's top-2 margin at each of its steps (prefill first, then decodes)."""
    margins = [[] for _ in tokens]
    for step in ref_logits:
        top2 = step.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]).tolist()
        # Every step of this run samples all live sequences in prompt order (same lengths, ignore_eos).
        for i, g in enumerate(gap[: len(tokens)]):
            margins[i].append(g)
    return zip(margins, tokens, ref_tokens)


if __name__ == "__main__":
    main()
