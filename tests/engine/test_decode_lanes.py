"""Device-tier sequences keep decoding while a host-tier step is in flight, and both lanes stay exact."""
import threading
import time

import cpu_attention
from offload_engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts


def test_device_lane_steps_while_the_host_lane_is_in_flight(qwen3_dir, monkeypatch):
    kernel = cpu_attention.paged_decode_attention

    def slow_kernel(*args):  # a host kernel far slower than a device step, as on a real GPU host
        time.sleep(0.02)
        return kernel(*args)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", slow_kernel)
    prompts = random_prompts((20, 21, 22, 23), 256, seed=50)
    # No promotion: the host lane keeps its sequences to the end, so its steps are there to overlap.
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", kv_promotion=False, num_gpu_blocks=5,
              num_cpu_blocks=8, cpu_block_size=16)
    spans = []
    runner = llm.engine.runner

    def timed(step, lane, is_prefill):
        def timed_step(seqs):
            start = time.perf_counter()
            tokens = step(seqs)
            spans.append((lane, is_prefill, start, time.perf_counter(), threading.current_thread().name))
            return tokens
        return timed_step

    runner.prefill = timed(runner.prefill, "device", True)
    runner.launch_device_decode = timed(runner.launch_device_decode, "device", False)
    runner.decode_host = timed(runner.decode_host, "host", False)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert {o.kv_location for o in outputs} == {"gpu", "cpu"}
    host = [(a, b) for lane, prefill, a, b, _ in spans if lane == "host"]
    device = [(a, b) for lane, prefill, a, b, _ in spans if lane == "device" and not prefill]
    overlapped = sum(any(h0 < d0 and d1 < h1 for h0, h1 in host) for d0, d1 in device)
    assert host and overlapped >= 1  # device steps ran inside a host step's span: the lanes are concurrent
    assert all(name.startswith("host-lane") for lane, _, _, _, name in spans if lane == "host")
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 8)):
        assert output.token_ids[: len(ref)] == ref


def test_both_lanes_busy_for_many_steps_stay_exact(qwen3_dir):
    """Both lanes decode side by side for every step (on CUDA: on their own streams, replaying their own
    graphs at once). A buffer the two shared, such as a cuBLAS workspace baked into both lanes' graphs,
    would corrupt one lane's tokens here."""
    prompts = random_prompts((20, 21, 22, 23, 24, 25, 26, 27, 28, 29), 256, seed=51)
    # Five prompts on each tier. The host pool holds every sequence at full length (and those the device
    # demotes), so no host sequence is ever preempted: which would leave the tier counts to the lanes' timing.
    llm = LLM(qwen3_dir, device=TEST_DEVICE, kv_placement="auto", kv_promotion=False, num_gpu_blocks=10,
              num_cpu_blocks=40, cpu_block_size=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.kv_location for o in outputs].count("cpu") >= 5
    for output, ref in zip(outputs, hf_greedy(qwen3_dir, prompts, 24)):
        assert output.token_ids[: len(ref)] == ref
    llm.close()
