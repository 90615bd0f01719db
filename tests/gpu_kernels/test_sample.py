"""sample_tokens (the one-pass sampling kernel) against float64 references over the same Philox uniforms, and the
uniforms themselves against a plain-integer Philox 4x32-10."""
import pytest
import torch

from gpu_kernels.sample import sample_tokens
from offload_engine.layers.philox import philox_uniform
from tests.conftest import TEST_DEVICE, requires_cuda


def _philox_word(key: int, counter: int) -> int:
    """Philox 4x32-10's first output word, on Python integers (Salmon et al., 2011), as tl.rand runs it."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter, 0, 0, 0
    k0, k1 = key & mask, (key >> 32) & mask
    for _ in range(10):
        p_b, p_a = 0xCD9E8D57 * c2, 0xD2511F53 * c0
        c0, c1, c2, c3 = (p_b >> 32) ^ c1 ^ k0, p_b & mask, (p_a >> 32) ^ c3 ^ k1, p_a & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0


def test_philox_uniforms_match_plain_integer_philox():
    keys = [0, 1, 2**40 + 17, -5, 2**63 - 1]
    uniforms = philox_uniform(torch.tensor(keys, dtype=torch.int64), 300)
    for row, key in enumerate(keys):
        for column in (0, 1, 2, 255, 299):
            word = _philox_word(key % 2**64, column)
            signed = word - 2**32 if word >= 2**31 else word
            expected = torch.tensor(float(-signed - 1 if signed < 0 else signed), dtype=torch.float32) \
                * torch.tensor(4.6566127342e-10, dtype=torch.float32)
            assert uniforms[row, column] == expected, (key, column)


def _reference(logits, temperatures, keys):
    """float64 scores from the same uniforms: argmax(x / t - log(-log u)) where t > 0, argmax(x) elsewhere; and
    each row's margin between its best two scores."""
    x = logits.double()
    u = philox_uniform(keys, logits.shape[1]).double()
    sampled = (temperatures > 0).unsqueeze(1)
    scores = torch.where(sampled, x / temperatures.double().clamp_min(1e-30).unsqueeze(1) - torch.log(-torch.log(u)), x)
    top2 = scores.topk(2, dim=1).values
    return scores.argmax(dim=1), top2[:, 0] - top2[:, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,tile", [(50, 64), (1000, 256), (3000, 1024)])  # 1 tile; 4 with a ragged last
def test_sample_tokens_matches_float64(dtype, vocab, tile):
    gen = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    temperatures = torch.tensor([0.0, 0.3, 1.0, 2.5] * 3)
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
    got = sample_tokens(logits.to(TEST_DEVICE), temperatures.to(TEST_DEVICE), keys.to(TEST_DEVICE), tile=tile).cpu()
    expected, margin = _reference(logits, temperatures, keys)
    clear = margin > 1e-3  # float32 noise against float64: only near-ties could differ
    assert clear.sum() >= rows - 2
    assert torch.equal(got[clear], expected[clear])


def test_greedy_ties_go_to_the_first_column_across_tiles():
    logits = torch.randint(0, 3, (6, 700)).float()  # many ties at the maximum
    logits[0, :] = 0
    logits[0, 300], logits[0, 600] = 5, 5  # equal maxima in tiles 2 and 4 (tile 128)
    got = sample_tokens(logits.to(TEST_DEVICE), torch.zeros(6, device=TEST_DEVICE),
                        torch.zeros(6, dtype=torch.int64, device=TEST_DEVICE), tile=128).cpu()
    assert got[0] == 300
    assert torch.equal(got, logits.argmax(dim=1))  # torch.argmax returns the first maximum


def test_filtered_logits_are_never_drawn():
    rows, vocab = 64, 40
    logits = torch.full((rows, vocab), -float("inf"))
    logits[:, [3, 17, 39]] = torch.randn(rows, 3)
    keys = torch.arange(rows, dtype=torch.int64) * 7919
    got = sample_tokens(logits.to(TEST_DEVICE), torch.full((rows,), 50.0, device=TEST_DEVICE),
                        keys.to(TEST_DEVICE), tile=16).cpu()
    assert set(got.tolist()) == {3, 17, 39}  # at a high temperature all three show up, nothing else


def test_draws_follow_the_tempered_distribution():
    # The interpreter runs ~20 ms a row; the CPU path's distribution is tested on 20,000 rows (test_sampler.py).
    rows, temperature = (300 if TEST_DEVICE == "cpu" else 50_000), 0.7
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().repeat(rows, 1)
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64)
    got = sample_tokens(logits.to(TEST_DEVICE), torch.full((rows,), temperature, device=TEST_DEVICE),
                        keys.to(TEST_DEVICE), tile=4).cpu()
    expected = (probs.double().log() / temperature).softmax(0)
    freq = torch.bincount(got, minlength=4).double() / rows
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= 4.5 * sigma).all(), (freq, expected)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64 keys"):
        sample_tokens(torch.zeros(2, 8), torch.zeros(2), torch.zeros(2, dtype=torch.int32))


@requires_cuda
def test_sample_tokens_replays_in_a_cuda_graph():
    rows, vocab = 16, 151_936
    logits = torch.randn(rows, vocab, device="cuda")
    temperatures = torch.rand(rows, device="cuda") * torch.tensor([0.0, 1.0], device="cuda").repeat(8)
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64, device="cuda")
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    sample_tokens(logits, temperatures, keys, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_tokens(logits, temperatures, keys, out=out)
    logits.copy_(torch.randn(rows, vocab, device="cuda"))
    keys.copy_(torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64, device="cuda"))
    graph.replay()
    expected, margin = _reference(logits.cpu(), temperatures.cpu(), keys.cpu())
    clear = margin > 1e-3
    assert torch.equal(out.cpu()[clear], expected[clear])
