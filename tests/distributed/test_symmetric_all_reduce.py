"""Small all-reduces over symmetric memory (distributed/symmetric_all_reduce.py). On two GPUs, parallel_state's
all-reduce gives the exactly rounded sum on both ranks, bit for bit, for decode-sized bfloat16 tensors (the
one-shot) and for those the one-shot does not take (another dtype, too large, a size its vectors do not divide: NCCL
then), eagerly and replayed in a CUDA graph. Off CUDA, or with OFFLOAD_ENGINE_ALL_REDUCE=nccl, none is made; any
other value is a clear error. A later engine of the same process (whose groups reuse the first one's names, which
torch registers once) takes NCCL with a warning, where it would otherwise wait in a rendezvous that never meets."""
import pytest
import torch

from offload_engine.distributed import parallel_state
from offload_engine.distributed.symmetric_all_reduce import ENV, ONE_SHOT_MAX_BYTES, try_make, wanted
from tests.distributed.ranks import run_on_two_ranks

SHAPES = [  # (rows, columns, dtype, taken by the one-shot)
    (1, 4096, torch.bfloat16, True),
    (64, 4096, torch.bfloat16, True),
    (ONE_SHOT_MAX_BYTES // 8192, 4096, torch.bfloat16, True),  # the largest it takes
    (3, 5, torch.bfloat16, False),  # 30 bytes: not a whole number of its 16-byte vectors
    (16, 4096, torch.float32, False),
    (ONE_SHOT_MAX_BYTES // 8192 + 1, 4096, torch.bfloat16, False),
]


def test_a_value_other_than_auto_or_nccl_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="OFFLOAD_ENGINE_ALL_REDUCE='fast'"):
        wanted()


def test_none_is_made_off_cuda_or_when_switched_off(monkeypatch):
    assert try_make(None, torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv(ENV, "nccl")
    assert try_make(None, torch.device("cuda", 0), torch.bfloat16) is None


def test_a_group_name_this_process_used_before_is_refused_with_a_warning(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    monkeypatch.setattr(parallel_state, "_symmetric_names", set())
    gpu = torch.device("cuda", 0)  # never touched: the choice is made before any CUDA work
    assert parallel_state._may_make_symmetric(gpu, "0")
    assert not parallel_state._may_make_symmetric(torch.device("cpu"), "0")
    parallel_state._symmetric_names.add("0")
    with pytest.warns(UserWarning, match="first tensor-parallel engine of a process"):
        assert not parallel_state._may_make_symmetric(gpu, "0")
    assert parallel_state._may_make_symmetric(gpu, "1")
    monkeypatch.setenv(ENV, "nccl")
    assert not parallel_state._may_make_symmetric(gpu, "1")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
def test_two_engines_one_after_another_in_one_process_both_give_transformers_tokens(monkeypatch, qwen3_dir):
    """The first engine's small all-reduces take the one-shot, the second's NCCL; both are exact, neither waits."""
    from offload_engine import LLM, SamplingParams
    from tests.oracle import hf_greedy, random_prompts

    monkeypatch.setenv(ENV, "auto")
    prompts = random_prompts((9, 40), 256, seed=7)
    fresh = not parallel_state._symmetric_names  # no engine of this process has taken the one-shot yet
    used = []
    for _ in range(2):
        with LLM(qwen3_dir, device="cuda", tensor_parallel_size=2) as llm:
            used.append(parallel_state.uses_symmetric_memory("device"))
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
            assert [o.token_ids for o in outputs] == hf_greedy(qwen3_dir, prompts, 6)
    assert used == [fresh, False]


def test_gloo_ranks_use_no_symmetric_memory(tmp_path):
    run_on_two_ranks(_check_no_symmetric, str(tmp_path))


def _check_no_symmetric(rank: int, tmp_dir: str) -> None:
    assert not any(parallel_state.uses_symmetric_memory(lane) for lane in parallel_state.LANES)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
def test_on_two_gpus_every_sum_is_exact_and_the_same_on_both_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "auto")  # the spawned ranks inherit it
    run_on_two_ranks(_check_sums, str(tmp_path), device="cuda")


def _inputs(rows: int, columns: int, dtype, seed: int) -> list[torch.Tensor]:
    """Both ranks' inputs, made on every rank from the same seeds."""
    return [torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed + r)).to(dtype) for r in range(2)]


def _check_sums(rank: int, tmp_dir: str) -> None:
    device = torch.device("cuda", rank)
    for lane in parallel_state.LANES:
        assert parallel_state.uses_symmetric_memory(lane), lane
        with parallel_state.lane(lane):
            for seed, (rows, columns, dtype, _) in enumerate(SHAPES):
                both = _inputs(rows, columns, dtype, 10 * seed)
                want = (both[0].double() + both[1].double()).to(dtype)  # one rounding, as each rank's sum
                got = parallel_state.all_reduce(both[rank].to(device).clone())
                assert torch.equal(got.cpu(), want), (lane, rows, columns, dtype)
            _check_in_a_graph(device, rank)


def _check_in_a_graph(device: torch.device, rank: int) -> None:
    x = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        parallel_state.all_reduce(x)  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = parallel_state.all_reduce(x)
    for seed in (101, 202):
        both = _inputs(64, 4096, torch.bfloat16, seed)
        x.copy_(both[rank])
        graph.replay()
        assert torch.equal(y.cpu(), (both[0].double() + both[1].double()).to(torch.bfloat16)), seed


def test_a_bad_switch_is_named_before_any_rank_starts(monkeypatch, qwen3_dir):
    import multiprocessing

    from offload_engine import LLM
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="OFFLOAD_ENGINE_ALL_REDUCE='fast'"):
        LLM(qwen3_dir, device="cpu", tensor_parallel_size=2)
    assert multiprocessing.active_children() == []
