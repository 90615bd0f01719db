import numpy as np
import torch

from offload_engine.layers.sampler import SamplingBatch, sample, sampling_keys


def _batch(rows, temperature=1.0, top_k=None, top_p=1.0, vocab=50, keys=None):
    filtered = bool(top_k) or top_p < 1
    return SamplingBatch(
        temperatures=None if temperature == 0 else torch.full((rows,), float(temperature)),
        keys=keys if keys is not None else torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64),
        top_ks=torch.full((rows,), top_k or vocab, dtype=torch.int64) if filtered else None,
        top_ps=torch.full((rows,), float(top_p)) if filtered else None,
        needs_filter=filtered,
    )


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    assert torch.equal(sample(logits, _batch(6, temperature=0)), logits.argmax(-1))


def test_greedy_rows_beside_filtered_rows_stay_argmax():
    logits = torch.randn(4, 50)
    batch = _batch(4, temperature=2.0, top_k=3)
    batch.temperatures[::2] = 0
    batch.top_ks[::2] = 50  # as StepInputBuilder leaves greedy rows: unfiltered
    got = sample(logits, batch)
    assert torch.equal(got[::2], logits[::2].argmax(-1))


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.randn(1, 50).repeat(400, 1)
    tokens = sample(logits, _batch(400, temperature=5.0, top_k=3))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all three show up at a high temperature, nothing else


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    tokens = sample(logits, _batch(400, top_p=0.7, vocab=4))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 stops there


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    rows = 20000
    tokens = sample(probs.log().repeat(rows, 1), _batch(rows, vocab=3))
    freq = torch.bincount(tokens, minlength=3).double() / rows
    sigma = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert ((freq - probs.double()).abs() <= 4.5 * sigma).all(), freq


def test_out_receives_the_tokens():
    logits, out = torch.randn(3, 50), torch.full((5,), -7, dtype=torch.int64)
    got = sample(logits, _batch(3), out=out[:3])
    assert torch.equal(out[:3], got) and (out[3:] == -7).all()


def test_seeded_keys_depend_on_seed_and_position_only():
    rng = np.random.default_rng(0)
    alone = sampling_keys([7], np.array([12]), rng)
    batched = sampling_keys([None, 7, 7, 8, None], np.array([3, 12, 13, 12, 12]), np.random.default_rng(1))
    assert batched[1] == alone[0]
    assert len(set(batched.tolist())) == 5  # other positions, other seeds and unseeded rows: other keys
    huge = sampling_keys([2**64 + 7, -(2**63)], np.array([12, 0]), rng)  # any int is a seed
    assert huge[0] == alone[0]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50)
    keys = torch.from_numpy(sampling_keys([None, 7, None], np.array([5, 9, 5]), np.random.default_rng(2)))
    alone_keys = torch.from_numpy(sampling_keys([7], np.array([9]), np.random.default_rng(3)))
    batched = sample(logits, _batch(3, keys=keys))
    alone = sample(logits[1:2], _batch(1, keys=alone_keys))
    assert batched[1] == alone[0]
