"""Ranks started by torchrun instead of spawned by rank 0 (distributed/launch.py): two processes over gloo on
localhost, each running the same script. Rank 0's engine gives transformers' greedy tokens in every placement, the
other rank's `LLM(...)` serves it and ends its process when rank 0 closes, and a world of the wrong size is a clear
error on every rank."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import TEST_DEVICE
from tests.oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2,
                                reason="tensor_parallel_size=2 on CUDA needs two GPUs")

SCRIPT = textwrap.dedent("""
    import json, sys
    from offload_engine import LLM, SamplingParams

    model_dir, out, device, tp, placement, prompts = sys.argv[1:7]
    # One engine per launch: the other ranks serve it and end with it (README, "Several GPUs").
    with LLM(model_dir, device=device, kv_placement=placement, tensor_parallel_size=int(tp), num_gpu_blocks=8,
             num_cpu_blocks=40, cpu_block_size=16) as llm:
        outputs = llm.generate(json.loads(prompts), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
    with open(out, "w") as f:
        json.dump([[o.token_ids, o.kv_location] for o in outputs], f)
    print("rank 0 wrote", out)
    """)



def torchrun(tmp_path, *args, nproc: int = 2, timeout: float = 240):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(script), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("placement", ["gpu", "cpu"])
def test_two_ranks_started_by_torchrun_give_transformers_tokens(qwen3_dir, tmp_path, placement):
    prompts = random_prompts((5, 17, 33), 256, seed=91)
    out = tmp_path / "tokens.json"
    done = torchrun(tmp_path, qwen3_dir, out, TEST_DEVICE, 2, placement, json.dumps(prompts))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("rank 0 wrote") == 1  # rank 1's LLM(...) never returned to the script
    results = json.loads(out.read_text())
    for (tokens, _), want in zip(results, hf_greedy(qwen3_dir, prompts, 8)):  # transformers stops at eos
        assert len(tokens) == 8 and tokens[: len(want)] == want
    assert {location for _, location in results} == {placement}


def test_a_world_of_another_size_is_a_clear_error(qwen3_dir, tmp_path):
    done = torchrun(tmp_path, qwen3_dir, tmp_path / "never.json", TEST_DEVICE, 3, "gpu", "[[1, 2, 3]]", nproc=2)
    assert done.returncode != 0
    # Each rank raises it before any work; torchrun stops the other rank once one has failed, so it may not get to.
    assert "the launcher started 2 processes (WORLD_SIZE) but tensor_parallel_size is 3" in done.stderr
    assert not (tmp_path / "never.json").exists()


def test_a_world_of_another_size_is_named_before_the_devices_are_checked(monkeypatch, tmp_path):
    """Under a launcher, the world's size is the error to fix first: a device check would blame the GPUs (three
    ranks from cuda:0 on a host that has two, or none)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    from offload_engine import LLM
    with pytest.raises(ValueError, match="the launcher started 2 processes"):
        LLM(str(tmp_path), device="cuda:0", tensor_parallel_size=3)
