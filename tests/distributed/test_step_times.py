"""With $OFFLOAD_ENGINE_STEP_TIMES set (benchmarks only), each worker writes its device-lane steps at close: rows,
when rank 0's call reached it and when its step was queued (and, on CUDA, its graph replay's GPU time)."""
import json

import pytest
import torch

from offload_engine import LLM, SamplingParams
from offload_engine.distributed.step_times import ENV
from tests.conftest import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2,
                                reason="tensor_parallel_size=2 on CUDA needs two GPUs")


def test_each_worker_writes_its_device_steps_at_close(qwen3_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    with LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="gpu", num_gpu_blocks=32, tensor_parallel_size=2) as llm:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)
    steps = json.loads((tmp_path / "rank1.json").read_text())["steps"]
    assert [s["rows"] for s in steps] == [2] * 5  # the first token comes from the prefill step
    assert all(s["received"] <= s["queued"] for s in steps)
    replayed = [s["gpu_ms"] is not None for s in steps]  # graphs on CUDA only
    assert any(replayed) if TEST_DEVICE == "cuda" else not any(replayed)
