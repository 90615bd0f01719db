"""skinny_linear (decode's few-row projections) against float64 on fresh random data: ragged N and K against the
tiles, bias, the same bits every call, GQA-sized fused projections, no rows; bad shapes are clear errors. The shape
rule the layers take it by; on CUDA, the linear layers take it where it pays and match torch's GEMM."""
import pytest
import torch

from gpu_kernels import skinny_linear
from gpu_kernels.skinny_gemm import MAX_ROWS, launch_config
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


@pytest.mark.parametrize("block_k", [32, 64, 256])
def test_ragged_k_with_bias_gives_the_sum_and_the_same_bits_every_call(block_k):
    x, w, b = _case(4, 200, 40, torch.bfloat16, seed=block_k, bias=True)  # 200: ragged against every tile
    block_n, _, warps, stages = launch_config(4, 40, 200, torch.device(TEST_DEVICE))
    call = lambda: skinny_linear(x.to(TEST_DEVICE), w.to(TEST_DEVICE), b.to(TEST_DEVICE),
                                 config=(block_n, block_k, warps, stages))
    got = call()
    _check(got, x, w, b)
    assert torch.equal(got, call())


def test_the_shape_rule_takes_split_k_shapes_and_lm_heads_and_leaves_wide_projections_to_torch():
    """On a GPU of 132 SMs: the 8B's attention output and down projection, and a vocabulary head, take the kernel;
    its fused q/k/v and gate/up projections, and a 0.6B's attention output (too few columns to fill the SMs), do
    not."""
    from unittest import mock

    from gpu_kernels import skinny_gemm

    gpu = torch.device("cuda")
    with mock.patch.object(skinny_gemm, "interpreted", lambda device: False), \
            mock.patch.object(skinny_gemm, "sm_count", lambda device: 132):
        assert skinny_gemm.pays(4096, 4096, gpu) and skinny_gemm.pays(4096, 12288, gpu)
        assert skinny_gemm.pays(151936, 4096, gpu) and skinny_gemm.pays(151936, 1024, gpu)
        assert not skinny_gemm.pays(6144, 4096, gpu) and not skinny_gemm.pays(24576, 4096, gpu)
        assert not skinny_gemm.pays(1024, 2048, gpu)
    assert skinny_gemm.pays(8, 4, torch.device("cpu"))  # the interpreter's tests reach it at any shape


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
def test_the_linear_layers_take_it_where_it_pays_and_match_torch(rows, monkeypatch):
    from offload_engine.layers import fused, linear
    from offload_engine.layers.linear import Linear
    from gpu_kernels import skinny_gemm

    layer = Linear(8192, 4224, bias=True).to(device="cuda", dtype=torch.bfloat16)  # n <= k, 132 column blocks
    torch.nn.init.normal_(layer.weight, std=8192 ** -0.5)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16)
    assert skinny_gemm.pays(4224, 8192, x.device)
    calls = []
    monkeypatch.setattr(skinny_gemm, "skinny_linear",
                        lambda *a, swiglu=False: calls.append(1) or torch.ops.aten.linear(*a))
    layer(x)
    assert len(calls) == (rows <= linear.SKINNY_ROWS)
    monkeypatch.undo()
    on = layer(x)
    monkeypatch.setattr(fused, "DISABLED", {"skinny_gemm"})
    off = layer(x)
    _check(on, x.cpu(), layer.weight.cpu(), layer.bias.cpu())
    assert torch.allclose(on.double(), off.double(), rtol=2 ** -7, atol=1e-2)


def test_the_engine_with_every_decode_projection_on_it_gives_transformers_greedy_tokens(monkeypatch, qwen3_dir):
    """Forced on (off CUDA the layers would not take it, and a tiny model's shapes would not pay on a GPU): decode
    steps of a few rows, prefills of more, in float32 (wide K tiles)."""
    from gpu_kernels import skinny_gemm
    from offload_engine import LLM, SamplingParams
    from offload_engine.layers import linear
    from tests.oracle import hf_greedy, random_prompts

    monkeypatch.setattr(skinny_gemm, "pays", lambda n, k, device: True)
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
