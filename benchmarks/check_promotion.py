"""On the GPU: promotion (host tier -> device pool) keeps greedy tokens exact, with CUDA graphs and Triton.

A tiny float32 Qwen3 with a small device pool: the first sequences fill it, the long ones start on the host
tier and move up once the short ones finish. Their tokens must equal transformers' greedy generate (float32,
on the GPU), as they must without promotion and with every sequence on the device.
"""
import argparse
import json
import tempfile

import torch
from transformers import AutoModelForCausalLM

from offload_engine import LLM, SamplingParams
from offload_engine.tiny_model import build_tiny_model

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/check_promotion.json")
    args = parser.parse_args()
    path = build_tiny_model(tempfile.mkdtemp(), "qwen3", seed=5, with_tokenizer=False, **SHAPE)
    gen = torch.Generator().manual_seed(1)
    lengths, max_tokens = (40, 300, 41, 700, 39, 90, 130, 42), (8, 8, 8, 8, 64, 64, 64, 64)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    refs = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt], device="cuda")
        refs.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)[0, len(prompt):].tolist())
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    report = {}
    for name, kwargs in {"auto+promotion": dict(kv_placement="auto"),
                         "auto, no promotion": dict(kv_placement="auto", kv_promotion=False),
                         "gpu": dict(kv_placement="gpu")}.items():
        pool = dict(num_gpu_blocks=80, cpu_kv_cache_gb=1) if name != "gpu" else {}
        llm = LLM(path, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.2, **pool, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        report[name] = {
            "sequences_equal_to_transformers": sum(o.token_ids == r for o, r in zip(outputs, refs)),
            "tokens_equal": sum(a == b for o, r in zip(outputs, refs) for a, b in zip(o.token_ids, r)),
            "tokens": sum(max_tokens),
            "kv_location": [o.kv_location for o in outputs], "promoted": [o.kv_promoted for o in outputs],
            "promotions": llm.engine.scheduler.num_promotions, "backend": llm.kv_cache_summary["attention_backend"]}
        llm.close()
        print(name, json.dumps(report[name]))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
