"""Sizes the device KV pool from the memory left after the model's own peak (CUDA only).

A warmup prefill of the largest batch the scheduler can form runs through a temporary pool; what the model,
its activations and the sampler take at their peak, plus everything else already on the card, is subtracted
from total memory x gpu_memory_utilization. The rest is the KV pool.
"""
import torch

from offload_engine.engine.sequence import BlockLocation, Sequence
from offload_engine.sampling_params import SamplingParams

_SAMPLER_COPIES = 4  # logits, scaled logits, sorted logits and probabilities, float32, for a full decode batch


@torch.inference_mode()
def profile_free_kv_bytes(runner) -> int:
    cfg = runner.cfg
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()

    seq_len = min(runner.max_model_len, cfg.max_num_batched_tokens)
    num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // seq_len))
    blocks_per_seq = -(-seq_len // cfg.block_size)
    pool = runner.allocate_device_pool(num_seqs * blocks_per_seq)
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in pool)
    runner.bind_kv_caches(pool, None)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence([0] * seq_len, SamplingParams(), budget=seq_len)
        seq.location, seq.num_scheduled_tokens = BlockLocation.GPU, seq_len
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(seq)
    step = runner.inputs.prefill(seqs)
    hidden = runner.model(step.token_ids, step.positions, step.meta)
    runner.model.compute_logits(hidden[step.sample_rows])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - allocated_before - pool_bytes
    del pool, hidden, step
    runner.bind_kv_caches([(None, None)] * runner.model_cfg.num_layers, None)
    torch.cuda.empty_cache()

    sampler = _SAMPLER_COPIES * cfg.max_num_seqs * runner.model_cfg.vocab_size * 4
    return int(total * cfg.gpu_memory_utilization - (total - free) - peak - sampler)
