import torch

from offload_engine.layers.sampler import SamplingBatch, sample


def _batch(rows, temperature=1.0, top_k=None, top_p=1.0, generators=None, vocab=50):
    return SamplingBatch(
        temperatures=torch.full((rows,), float(temperature)),
        top_ks=torch.full((rows,), top_k or vocab, dtype=torch.int64),
        top_ps=torch.full((rows,), float(top_p)),
        generators=generators or [None] * rows,
        all_greedy=temperature == 0,
        needs_filter=bool(top_k) or top_p < 1,
    )


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    assert torch.equal(sample(logits, _batch(6, temperature=0), torch.Generator()), logits.argmax(-1))


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.randn(1, 50).repeat(400, 1)
    tokens = sample(logits, _batch(400, temperature=5.0, top_k=3), torch.Generator().manual_seed(0))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all three show up at a high temperature, nothing else


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    tokens = sample(logits, _batch(400, top_p=0.7, vocab=4), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 stops there


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(6000, 1)
    tokens = sample(logits, _batch(6000, vocab=3), torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], _batch(1, generators=[torch.Generator().manual_seed(7)]), torch.Generator().manual_seed(1))
    gens = [None, torch.Generator().manual_seed(7), None]
    batched = sample(logits, _batch(3, generators=gens), torch.Generator().manual_seed(2))
    assert batched[1] == alone[0]
