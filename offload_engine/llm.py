"""The public entry point: `LLM(model_dir, ...).generate(prompts, sampling_params)`."""
import json
import os
import weakref

import torch
from tqdm.auto import tqdm

from offload_engine.config import DTYPES, EngineConfig, ModelConfig
from offload_engine.engine.llm_engine import LLMEngine
from offload_engine.engine.sequence import Sequence
from offload_engine.outputs import RequestOutput
from offload_engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model_dir: str | None = None, device: str | None = None, dtype: str = "auto",
                 kv_placement: str = "auto", kv_promotion: bool = True, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 cpu_kv_cache_gb: float | None = None, block_size: int = 16, cpu_block_size: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 16384,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, enable_prefix_caching: bool = True,
                 attention_backend: str = "auto", seed: int = 0, model: str | None = None,
                 prefill_segment_tokens: int | None = None, async_scheduling: bool = True,
                 tensor_parallel_size: int = 1, prefill_device: str | None = None, prefill_graph_tokens: int = 8192,
                 stream_host_kv: bool = True, stream_staging_gb: float = 1.0):
        """`model=` is accepted as vLLM spells it; `model_dir` (first positional) is the same thing.

        kv_placement: "gpu", "cpu" or "auto". kv_promotion (auto only): once the device pool has room that no waiting
        request can take, host-tier sequences move their KV up and decode there. prefill_segment_tokens: prompt tokens
        of a host-tier or split sequence one layer-major prefill step takes; None sizes it from the device memory left
        after start-up. tensor_parallel_size: ranks, one process per device from `device` on. prefill_device: prompts
        are prefilled there and decoded on `device`. prefill_graph_tokens: prefill steps of device-tier rows up to this
        many tokens (at most max_num_batched_tokens) replay CUDA graphs, whose memory comes out of the KV pool's share;
        0 runs prefill eagerly. async_scheduling: the device lane queues its next step before reading this one's tokens.
        stream_host_kv: a host step also streams a share of its rows' host KV over PCIe and attends it on the device,
        beside the CPU kernel (False: the CPU kernel reads all of it); stream_staging_gb: the device memory that
        streaming's double-buffered staging takes, at most (it comes out of the KV pool's share).
        """
        model = model_dir if model_dir is not None else model
        if model is None:
            raise ValueError("pass the model directory: LLM('path/to/model')")
        self.config = EngineConfig(
            device=device, dtype=dtype, kv_placement=kv_placement, kv_promotion=kv_promotion,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks, cpu_kv_cache_gb=cpu_kv_cache_gb, block_size=block_size,
            cpu_block_size=cpu_block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, prefill_segment_tokens=prefill_segment_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching, async_scheduling=async_scheduling,
            attention_backend=attention_backend, seed=seed, tensor_parallel_size=tensor_parallel_size,
            prefill_device=prefill_device, prefill_graph_tokens=prefill_graph_tokens, stream_host_kv=stream_host_kv,
            stream_staging_gb=stream_staging_gb)
        self.config.validate()
        if not os.path.isdir(model):
            raise OSError(f"model directory {model!r} does not exist: pass a Hugging Face model directory "
                          "(config.json + *.safetensors)")
        self.model_dir = model
        self.model_config = ModelConfig.from_model_dir(model)
        self.model_config.check_tensor_parallel(tensor_parallel_size)
        self.max_model_len = self._max_model_len()
        self.dtype = self.model_config.dtype if dtype == "auto" else DTYPES[dtype]
        self.tokenizer = _load_tokenizer(model)
        torch.manual_seed(seed)
        self.engine = LLMEngine.load(model, self.model_config, self.config, self.dtype, self.max_model_len,
                                     _eos_token_ids(model, self.model_config))
        # close(), `with`, and garbage collection all release the same things through this (once). It holds
        # the engine, never this object, so an LLM that is dropped unclosed is still collected and released.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}: lower it")
        return self.config.max_model_len

    @property
    def kv_cache_summary(self) -> dict:
        runner = self.engine.runner
        return {"device_blocks": runner.num_gpu_blocks, "block_size": self.config.block_size,
                "host_blocks": runner.num_cpu_blocks, "cpu_block_size": self.config.cpu_block_size,
                "attention_backend": runner.backend.name}

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in prompt order. Bad input raises before any work."""
        if not self._finalizer.alive:
            raise ValueError("this LLM has been closed: make a new LLM(...) to generate again")
        texts, token_lists = self._tokenize(prompts)
        params = self._per_prompt_params(sampling_params, len(token_lists))
        seqs = [self.engine.make_sequence(ids, p) for ids, p in zip(token_lists, params)]
        for seq in seqs:
            self.engine.add(seq)
        try:
            self._run(len(seqs), use_tqdm)
        except BaseException:
            self.engine.abort()  # the error (or KeyboardInterrupt) goes on up; the engine is left empty and usable
            raise
        return [self._output(text, seq) for text, seq in zip(texts, seqs)]

    def _run(self, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        rates = {"prefill": 0.0, "decode": 0.0}
        try:
            while self.engine.has_work():
                stats = self.engine.step()
                rates["prefill" if stats.is_prefill else "decode"] = stats.num_tokens / max(stats.seconds, 1e-9)
                bar.set_postfix_str(f"prefill {rates['prefill']:.0f} tok/s, decode {rates['decode']:.0f} tok/s",
                                    refresh=False)  # redrawn at tqdm's own pace, not every step
                bar.update(len(stats.finished))
        finally:
            bar.close()

    def _tokenize(self, prompts) -> tuple[list, list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError("prompts looks like one token-id list: pass a list of token-id lists, e.g. [[1, 2, 3]]")
        texts, token_lists = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"{self.model_dir!r} has no tokenizer: pass token-id lists instead of strings")
                texts.append(prompt)
                token_lists.append(self.tokenizer.encode(prompt))
            elif isinstance(prompt, (list, tuple)):
                texts.append(None)
                token_lists.append(list(prompt))
            else:
                raise ValueError(f"prompt {i} is a {type(prompt).__name__}: pass strings or token-id lists")
            self._check_prompt(i, token_lists[-1])
        return texts, token_lists

    def _check_prompt(self, i: int, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt {i} has token id {bad!r} outside [0, {vocab}): use this model's tokenizer")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt {i} has {len(token_ids)} tokens, at or over max_model_len={self.max_model_len}: "
                             "shorten it or raise max_model_len")

    @staticmethod
    def _per_prompt_params(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts: pass one, or one per prompt")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be SamplingParams objects")
        return params

    def _output(self, text: str | None, seq: Sequence) -> RequestOutput:
        completion = seq.completion_token_ids
        decoded = self.tokenizer.decode(completion, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(prompt=text, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                             token_ids=completion, text=decoded, finish_reason=seq.finish_reason,
                             kv_location=seq.kv_location, kv_device_tokens=seq.admitted_device_tokens,
                             kv_promoted=seq.promoted, kv_demoted=seq.demoted)

    def close(self) -> None:
        """Releases the host pool's pinning, the executor threads, the CUDA graphs and both pools. Idempotent;
        `with LLM(...) as llm:` calls it, and so does garbage collection of an LLM that was never closed."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _load_tokenizer(model_dir: str):
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: str, cfg: ModelConfig) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's, as transformers' generate uses both."""
    ids = set(cfg.eos_token_ids)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))
