"""benchmarks/simulate_placement.py drives the real LLMEngine._step, Scheduler and placement with fake lanes: it
must keep up with the engine (it once broke silently when async scheduling added state), and every token of every
request must be decoded once under both policies."""
import pytest

from benchmarks.simulate_placement import Point, compare


@pytest.mark.parametrize("blocks", [40, 24])  # tight enough that gpu recomputes and auto demotes and promotes
def test_both_policies_decode_every_token_through_the_real_scheduler(blocks):
    point = Point("qwen3-0.6b", num_seqs=12, prompt_len=96, output_len=48, num_gpu_blocks=blocks)
    result = compare(point)
    for policy in ("gpu", "auto"):
        run = result[policy]
        # The first token of a request, and again after each recompute, comes from its prefill.
        prefill_tokens = point.num_seqs + run["recomputes"]
        assert run["device_tokens"] + run["host_tokens"] + prefill_tokens == point.num_seqs * point.output_len
        assert run["seconds"] > 0
    assert result["gpu"]["host_tokens"] == 0 and result["gpu"]["recomputes"] > 0
    assert result["auto"]["recomputes"] == 0 and result["auto"]["host_tokens"] > 0
    assert result["auto"]["promotions"] > 0
