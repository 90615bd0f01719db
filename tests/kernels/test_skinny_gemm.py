"""skinny_linear (decode's few-row projections) against float64 on fresh random data: ragged N and K against the
tiles, one slice of K and several (split-K summed in slice order: the same bits every call), bias, GQA-sized fused
projections, no rows; bad shapes are clear errors. On CUDA, the linear layers take it when switched on and match
torch's GEMM."""
import pytest
import torch

from kernels import skinny_linear
from kernels.skinny_gemm import MAX_ROWS, launch_config
from tests.conftest import TEST_DEVICE

# One rounding of the dtype (the interpreter truncates bf16 instead of rounding: up to one ulp more) on top of
# float32 accumulation, whose error is measured against the sum of |x| |w|.
RTOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def _case(rows: int, k: int, n: int, dtype, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(got: torch.Tensor, x, w, b) -> None:
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    assert got.dtype == x.dtype and got.shape == exact.shape
    error = (got.cpu().double() - exact).abs()
    assert bool((error <= RTOL[x.dtype] * exact.abs() + 1e-5 * scale).all()), error.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (3, 100, 70), (16, 256, 33), (5, 512, 16), (7, 96, 160)])
def test_matches_float64(dtype, rows, k, n):
    x, w, _ = _case(rows, k, n, dtype, seed=rows * k + n)
    _check(skinny_linear(x.to(TEST_DEVICE), w.to(TEST_DEVICE)), x, w, None)


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_every_slicing_of_k_gives_the_sum_with_bias(splits):
    x, w, b = _case(4, 200, 40, torch.bfloat16, seed=splits, bias=True)  # 200: 7 tiles of 32, the last ragged
    block_n, block_k, _, warps, stages = launch_config(4, 40, 200, torch.device(TEST_DEVICE))
    got = skinny_linear(x.to(TEST_DEVICE), w.to(TEST_DEVICE), b.to(TEST_DEVICE),
                        config=(block_n, block_k, splits, warps, stages))
    _check(got, x, w, b)
    again = skinny_linear(x.to(TEST_DEVICE), w.to(TEST_DEVICE), b.to(TEST_DEVICE),
                          config=(block_n, block_k, splits, warps, stages))
    assert torch.equal(got, again)


def test_the_shape_rule_splits_k_where_columns_are_few_and_not_where_they_are_many():
    device = torch.device(TEST_DEVICE)
    assert launch_config(1, 32, 4096, device)[2] > 1
    assert launch_config(1, 1 << 20, 4096, device)[2] == 1


def test_strided_rows_no_rows_and_bad_shapes():
    x, w, _ = _case(6, 64, 24, torch.float32, seed=3)
    wide = torch.zeros(6, 80)
    wide[:, :64] = x
    _check(skinny_linear(wide[:, :64].to(TEST_DEVICE), w.to(TEST_DEVICE)), x, w, None)
    assert skinny_linear(torch.zeros(0, 64, device=TEST_DEVICE), w.to(TEST_DEVICE)).shape == (0, 24)
    with pytest.raises(ValueError, match=f"M <= {MAX_ROWS}"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="contiguous weight"):
        skinny_linear(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="contiguous weight"):
        skinny_linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, torch.zeros(23))


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the layers take the kernel on CUDA tensors only")
@pytest.mark.parametrize("rows", [1, 8, 16, 17])
def test_the_linear_layers_take_it_when_switched_on_and_match_torch(rows):
    from offload_engine.layers import fused
    from offload_engine.layers.linear import Linear

    layer = Linear(512, 384, bias=True).to(device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=512 ** -0.5)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    off = layer(x)
    fused.TRIED.add("skinny_gemm")
    try:
        on = layer(x)
    finally:
        fused.TRIED.discard("skinny_gemm")
    _check(on, x.cpu(), layer.weight.cpu(), layer.bias.cpu())
    assert torch.allclose(on.double(), off.double(), rtol=2 ** -7, atol=1e-2)


def test_the_engine_with_every_decode_projection_on_it_gives_transformers_greedy_tokens(monkeypatch, qwen3_dir):
    """Forced on (off CUDA the layers would not take it): decode steps of a few rows, prefills of more."""
    from offload_engine import LLM, SamplingParams
    from offload_engine.layers import linear
    from tests.oracle import hf_greedy, random_prompts

    taken, chosen = [], linear.use_fused

    def use_fused(x, kernel: str) -> bool:
        if kernel != "skinny_gemm":
            return chosen(x, kernel)
        taken.append(x.shape[0])
        return True

    monkeypatch.setattr(linear, "use_fused", use_fused)
    prompts = random_prompts((9, 40, 3), 256, seed=11)
    with LLM(qwen3_dir, device=TEST_DEVICE, dtype="float32") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(qwen3_dir, prompts, 6)
    assert taken and max(taken) <= linear.SKINNY_ROWS


def test_the_layers_row_limit_is_the_kernels():
    from offload_engine.layers.linear import SKINNY_ROWS

    assert SKINNY_ROWS == MAX_ROWS
