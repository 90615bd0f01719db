"""The public entry point: `LLM(model_dir, ...).generate(prompts, sampling_params)`."""
import dataclasses
import functools
import numbers
import os
import threading
import weakref

import torch
from tqdm.auto import tqdm

from offload_engine.config import ATTENTION_BACKENDS, DTYPES, EngineConfig, ModelConfig, read_json_object
from offload_engine.distributed.launch import launched_rank
from offload_engine.distributed.worker import launched_worker_main
from offload_engine.engine.llm_engine import LLMEngine
from offload_engine.engine.sequence import Sequence
from offload_engine.completions import matched_stop_string, request_output
from offload_engine.outputs import RequestOutput
from offload_engine.sampling_params import SamplingParams
from offload_engine.tokenizer import load_tokenizer


BACKEND_VARIABLE = "OFFLOAD_ENGINE_ATTENTION_BACKEND"  # attention_backend's default where the argument is not given


def _backend_from_environment() -> str:
    value = os.environ.get(BACKEND_VARIABLE, "auto")
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={value!r} names no attention backend: set it to one of "
                         f"{', '.join(ATTENTION_BACKENDS)}, or unset it")
    return value


class LLM:
    def __init__(self, model_dir: str | None = None, device: str | None = None, dtype: str = "auto",
                 kv_placement: str = "auto", kv_promotion: bool = True, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                 cpu_kv_cache_gb: float | None = None, block_size: int = 16, cpu_block_size: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 16384,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, enable_prefix_caching: bool = True,
                 attention_backend: str | None = None, seed: int = 0, model: str | None = None,
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
        attention_backend: None takes $OFFLOAD_ENGINE_ATTENTION_BACKEND, else "auto", as vLLM reads
        VLLM_ATTENTION_BACKEND (`OFFLOAD_ENGINE_ATTENTION_BACKEND=flash-attn make test-gpu` runs the suite on it).
        stream_host_kv: a host step also streams a share of its rows' host KV over PCIe and attends it on the device,
        beside the CPU kernel (False: the CPU kernel reads all of it); stream_staging_gb: the device memory that
        streaming's double-buffered staging takes, at most (it comes out of the KV pool's share).
        """
        # One caller at a time drives the engine: generate() and chat() from several threads run one after another,
        # each with exactly its own requests and results.
        self._lock = threading.RLock()
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
            attention_backend=attention_backend or _backend_from_environment(), seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            prefill_device=prefill_device, prefill_graph_tokens=prefill_graph_tokens, stream_host_kv=stream_host_kv,
            stream_staging_gb=stream_staging_gb)
        # A launcher's world of another size fails first, on every rank: the devices' check would blame the GPUs.
        launch = launched_rank(tensor_parallel_size) if isinstance(tensor_parallel_size, int) else None
        self.config.validate()
        if not os.path.isdir(model):
            raise OSError(f"model directory {model!r} does not exist: pass a Hugging Face model directory "
                          "(config.json + *.safetensors)")
        self.model_dir = model
        self.model_config = ModelConfig.from_model_dir(model)
        self.model_config.check_tensor_parallel(tensor_parallel_size)
        if launch is not None and launch.rank > 0:  # started by torchrun beside rank 0: serve its engine
            launched_worker_main(launch)  # ends this process once rank 0 closes the engine; never returns
        self.max_model_len = self._max_model_len()
        self.dtype = self.model_config.dtype if dtype == "auto" else DTYPES[dtype]
        self.tokenizer = load_tokenizer(model)
        torch.manual_seed(seed)
        self.engine = LLMEngine.load(model, self.model_config, self.config, self.dtype, self.max_model_len,
                                     _eos_token_ids(model, self.model_config))
        # close(), `with`, and garbage collection all release the same things through this (once). It holds
        # the engine, never this object, so an LLM that is dropped unclosed is still collected and released.
        self._finalizer = weakref.finalize(self, self.engine.close)
        if self.tokenizer is not None:
            self.engine.scheduler.stop_strings = functools.partial(matched_stop_string, self.tokenizer)

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
        """Generates for every prompt; outputs come back in prompt order. A prompt is a string, a list of token ids,
        or vLLM's {"prompt": str} / {"prompt_token_ids": [...]}. Bad input raises before any work. Safe to call from
        several threads: the calls run one after another."""
        with self._lock:
            if not self._finalizer.alive:
                raise ValueError("this LLM has been closed: make a new LLM(...) to generate again")
            texts, token_lists = self._tokenize(prompts)
            params = self._per_prompt_params(sampling_params, len(token_lists))
            if self.tokenizer is None and any(p.stop for p in params):
                raise ValueError(f"{self.model_dir!r} has no tokenizer to match stop strings on: use stop_token_ids")
            requests = [self._completions(ids, p) for ids, p in zip(token_lists, params)]
            for seq in (seq for completions in requests for seq in completions):
                self.engine.add(seq)
            try:
                self._run(sum(map(len, requests)), use_tqdm)
            except BaseException:
                self.engine.abort()  # the error (or KeyboardInterrupt) goes on up; the engine is left empty, usable
                raise
            return [request_output(text, completions, self.tokenizer) for text, completions in zip(texts, requests)]

    def _completions(self, token_ids: list[int], params: SamplingParams) -> list[Sequence]:
        """params.n sequences of the prompt; the i-th seeded with seed + i, and every one after the first admitted
        once the first has computed the prompt, so that they share its blocks (prefix caching)."""
        children = [params] if params.n == 1 else [
            dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]
        seqs = [self.engine.make_sequence(token_ids, p) for p in children]
        for seq in seqs[1:]:
            seq.after = seqs[0]
        if params.min_tokens:
            eos = () if params.ignore_eos else self.engine.scheduler.eos_token_ids
            for seq in seqs:
                seq.min_tokens_bans = sorted(set(params.stop_token_ids) | set(eos))
        return seqs

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generates a reply to one conversation (a list of {"role", "content"} messages) or to each of a list of
        them, rendered by the model directory's chat template (or `chat_template`), as vLLM's LLM.chat."""
        conversations = self._conversations(messages)
        hf = self.get_tokenizer()
        if chat_template is None and not getattr(hf, "chat_template", None):
            raise ValueError(f"{self.model_dir!r} has no chat template (tokenizer_config.json's 'chat_template'): "
                             "pass chat_template=... or use generate()")
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt and
                      not continue_final_message, continue_final_message=continue_final_message,
                      **(chat_template_kwargs or {}))
        texts = [hf.apply_chat_template(c, tokenize=False, **kwargs) for c in conversations]
        # The template writes the special tokens it wants (a BOS, say): the rendered text adds none of its own.
        prompts = [{"prompt": t, "prompt_token_ids": hf.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _conversations(messages) -> list[list[dict]]:
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) and "role" in m for m in c)
                for c in messages):
            raise ValueError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) "
                             "or a list of conversations")
        return [list(c) for c in messages]

    def get_tokenizer(self):
        """The model directory's tokenizer as transformers loads it (vLLM's LLM.get_tokenizer)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir!r} has no tokenizer (tokenizer.json or tokenizer_config.json)")
        return self.tokenizer.hf()

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
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if prompts and all(_is_token_id(p) for p in prompts):
            raise ValueError("prompts looks like one token-id list: pass a list of token-id lists, e.g. [[1, 2, 3]]")
        texts, token_lists = [], []
        for i, prompt in enumerate(prompts):
            text, ids = self._prompt(i, prompt)
            texts.append(text)
            token_lists.append(ids)
            self._check_prompt(i, ids)
        return texts, token_lists

    def _prompt(self, i: int, prompt) -> tuple[str | None, list]:
        """(its text, its token ids) of prompt i."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_list(i, prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt(i, prompt["prompt"])
            raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids': pass one of them")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir!r} has no tokenizer: pass token-id lists instead of strings")
            return prompt, self.tokenizer.encode(prompt)
        return None, self._token_list(i, prompt)

    @staticmethod
    def _token_list(i: int, ids) -> list:
        if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:  # a numpy array or a 1-D tensor
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt {i} is a {type(ids).__name__}: pass strings or token-id lists")
        if _all_ints(ids):
            return list(ids)
        return [int(t) if _is_token_id(t) else t for t in ids]

    def _check_prompt(self, i: int, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        vocab = self.model_config.vocab_size
        in_range = _all_ints(token_ids) and min(token_ids) >= 0 and max(token_ids) < vocab
        bad = None if in_range else next((t for t in token_ids if not _is_token_id(t) or not 0 <= t < vocab), None)
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

    def close(self) -> None:
        """Releases the host pool's pinning, the executor threads, the CUDA graphs and both pools. Idempotent;
        `with LLM(...) as llm:` calls it, and so does garbage collection of an LLM that was never closed. A
        generate() running on another thread finishes first."""
        with self._lock:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _all_ints(ids) -> bool:
    """Whether every element is exactly a Python int, checked at C speed: the common case, where a check token by
    token (_is_token_id's ABC test) took about 0.5 s of a call's wall time for 262,144 prompt tokens."""
    return set(map(type, ids)) <= {int}


def _is_token_id(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _eos_token_ids(model_dir: str, cfg: ModelConfig) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's, as transformers' generate uses both."""
    ids = set(cfg.eos_token_ids)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        eos = read_json_object(path).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))
