"""The tensor-parallel layers against the plain ones: with one rank they are the plain layers, call for call; on two
gloo ranks (float64) each rank's column-parallel output is its slice of the plain output, and row-parallel, vocab
embedding and head outputs are the whole plain output on every rank, a vocabulary the ranks do not divide included.
The two lanes' collectives, made from two threads in different orders on the two ranks, never pair up."""
import random
import threading
import time

import torch
from torch import nn

from offload_engine.distributed import parallel_state
from offload_engine.distributed.parallel_state import Partition
from offload_engine.layers.activation import SiluAndMul
from offload_engine.layers.embedding import LMHead, VocabEmbedding
from offload_engine.layers.linear import ColumnParallelLinear, FusedLinear, RowParallelLinear
from tests.distributed.ranks import run_on_two_ranks

HIDDEN, VOCAB = 8, 11  # 11 tokens over 2 ranks: one padding row on rank 1
PARTS = {"q": 8, "k": 4, "v": 4}


def _weights():
    """The same 'checkpoint' on every rank."""
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    return dict(x=randn(5, HIDDEN), parts={name: randn(size, HIDDEN) for name, size in PARTS.items()},
                part_biases={name: randn(size) for name, size in PARTS.items()}, row=randn(6, 16), row_bias=randn(6),
                gate=randn(12, HIDDEN), up=randn(12, HIDDEN), down=randn(HIDDEN, 12), vocab=randn(VOCAB, HIDDEN))


def _fused(w, tp):
    layer = FusedLinear(HIDDEN, PARTS, bias=True, tp=tp).double()
    for name in PARTS:
        layer.load_weight(layer.weight, w["parts"][name], name)
        layer.load_weight(layer.bias, w["part_biases"][name], name)
    return layer


def _row(w, tp):
    layer = RowParallelLinear(16, 6, bias=True, tp=tp).double()
    layer.load_weight(layer.weight, w["row"])
    layer.load_weight(layer.bias, w["row_bias"])
    return layer


def _vocab(cls, w, tp):
    layer = cls(VOCAB, HIDDEN, tp).double()
    layer.load_weight(layer.weight, w["vocab"])
    return layer


def test_one_rank_is_the_plain_layer_call_for_call():
    w = _weights()
    whole = Partition()
    plain_fused = torch.cat([w["parts"][n] for n in PARTS]), torch.cat([w["part_biases"][n] for n in PARTS])
    assert torch.equal(_fused(w, whole)(w["x"]), nn.functional.linear(w["x"], *plain_fused))
    x16 = torch.cat([w["x"], w["x"]], dim=1)
    assert torch.equal(_row(w, whole)(x16), nn.functional.linear(x16, w["row"], w["row_bias"]))
    ids = torch.tensor([0, 3, 10, 3])
    assert torch.equal(_vocab(VocabEmbedding, w, whole)(ids), nn.functional.embedding(ids, w["vocab"]))
    assert torch.equal(_vocab(LMHead, w, whole)(w["x"]), nn.functional.linear(w["x"], w["vocab"]).float())
    column = ColumnParallelLinear(HIDDEN, 4, tp=whole).double()
    column.load_weight(column.weight, w["gate"][:4])
    assert torch.equal(column(w["x"]), nn.functional.linear(w["x"], w["gate"][:4]))


def test_two_ranks_give_the_plain_layers_outputs_and_keep_the_lanes_apart(tmp_path):
    run_on_two_ranks(_check_on_a_rank, str(tmp_path))  # one pair of processes for both checks: each costs seconds


def _check_on_a_rank(rank: int, tmp_dir: str) -> None:
    _check_layers(rank)
    _check_lanes(rank)


def _check_layers(rank: int) -> None:
    w, tp = _weights(), Partition(rank, 2)
    x = w["x"]
    with parallel_state.lane("device"):
        # Column-parallel, fused: this rank's q, k and v heads side by side.
        got = _fused(w, tp)(x)
        mine = [nn.functional.linear(x, w["parts"][n], w["part_biases"][n]).chunk(2, dim=1)[rank] for n in PARTS]
        torch.testing.assert_close(got, torch.cat(mine, dim=1), rtol=0, atol=1e-12)
        # Row-parallel: this rank's half of the input, the whole output (bias once) on every rank.
        x16 = torch.cat([x, 2 * x], dim=1)
        got = _row(w, tp)(x16.chunk(2, dim=1)[rank].contiguous())
        torch.testing.assert_close(got, nn.functional.linear(x16, w["row"], w["row_bias"]), rtol=0, atol=1e-12)
        # The MLP as the model chains it: gate/up column-parallel, down row-parallel.
        gate_up = FusedLinear(HIDDEN, {"gate": 12, "up": 12}, tp=tp).double()
        gate_up.load_weight(gate_up.weight, w["gate"], "gate")
        gate_up.load_weight(gate_up.weight, w["up"], "up")
        down = RowParallelLinear(12, HIDDEN, tp=tp).double()
        down.load_weight(down.weight, w["down"])
        act = SiluAndMul()
        plain = nn.functional.linear(act(torch.cat([x @ w["gate"].T, x @ w["up"].T], dim=1)), w["down"])
        torch.testing.assert_close(down(act(gate_up(x))), plain, rtol=0, atol=1e-12)
        # Vocab-parallel embedding and head, 11 tokens on 2 ranks (6 + 5 and a zero padding row); tied weights.
        ids = torch.tensor([0, 5, 6, 10, 6])
        embedding = _vocab(VocabEmbedding, w, tp)
        assert torch.equal(embedding(ids), nn.functional.embedding(ids, w["vocab"]))
        head = LMHead(VOCAB, HIDDEN, tp).double()
        head.weight = embedding.weight
        logits = head(x)
        assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32 and logits.is_contiguous()
        torch.testing.assert_close(logits, nn.functional.linear(x, w["vocab"]).float(), rtol=0, atol=1e-6)


def _check_lanes(rank: int) -> None:
    """Both lanes all-reduce at once from two threads, with timing that differs per rank and per call: lane
    L's k-th sum must be of both ranks' k-th values of lane L."""
    errors = []

    def lane(name: str, tag: float) -> None:
        jitter = random.Random(rank * 10 + int(tag))
        try:
            with parallel_state.lane(name):
                for k in range(30):
                    time.sleep(jitter.random() * 0.002)
                    value = parallel_state.all_reduce(torch.tensor([tag + k + 100 * rank], dtype=torch.float64))
                    assert value.item() == 2 * (tag + k) + 100, (name, k, value.item())
                    gathered = parallel_state.all_gather(torch.tensor([[tag + k + rank]]))
                    assert gathered.tolist() == [[tag + k, tag + k + 1]], (name, k, gathered)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=lane, args=(name, tag)) for name, tag in (("device", 1000.0), ("host", 0.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
