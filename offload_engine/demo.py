"""`make run` / `offload-engine demo`: a batch of long prompts on the embedded tiny model, both KV tiers."""
import time

import torch

from offload_engine.llm import LLM
from offload_engine.sampling_params import SamplingParams
from offload_engine.tiny_model import default_model_dir


def run_demo(num_requests: int = 16, prompt_len: int = 1024, max_tokens: int = 64, device: str | None = None) -> dict:
    model_dir = default_model_dir()
    # A device pool that holds about half the batch, so "auto" places the rest on the host tier.
    budget_blocks = -(-(prompt_len + max_tokens) // 16)
    llm = LLM(model_dir, device=device, kv_placement="auto", num_gpu_blocks=budget_blocks * num_requests // 2,
              num_cpu_blocks=budget_blocks * num_requests // 4 + 8, cpu_block_size=64, dtype="float32")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.model_config.vocab_size, (prompt_len,), generator=gen).tolist()
               for _ in range(num_requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    tiers = {tier: sum(o.kv_location == tier for o in outputs) for tier in ("gpu", "cpu")}
    summary = {"model": model_dir, "device": llm.config.device, "requests": len(outputs),
               "prompt_tokens": num_requests * prompt_len, "generated_tokens": generated, "seconds": seconds,
               "output_tok_per_s": generated / seconds, "kv_location": tiers, **llm.kv_cache_summary}
    llm.close()
    print(f"\nmodel            {model_dir}\ndevice           {summary['device']} "
          f"({summary['attention_backend']} attention on the device tier)")
    print(f"requests         {summary['requests']} x {prompt_len} prompt tokens, {max_tokens} new tokens each")
    print(f"generated        {generated} tokens in {seconds:.2f} s = {summary['output_tok_per_s']:.1f} tok/s "
          f"(prompt + output: {(num_requests * prompt_len + generated) / seconds:.0f} tok/s)")
    print(f"KV lived on      device tier: {tiers['gpu']} requests, host tier: {tiers['cpu']} requests")
    print(f"pools            device {summary['device_blocks']} blocks x {summary['block_size']}, "
          f"host {summary['host_blocks']} blocks x {summary['cpu_block_size']} tokens")
    print(f"sample output    {outputs[0].text!r}"[:200])
    return summary
