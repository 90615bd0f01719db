"""Kernels compile at start-up, not in a step: a first generate that takes every path between the tiers (host rows,
eager prefills of mixed steps, splits, promotions, streamed host KV) compiles no Triton kernel. It runs in a fresh
interpreter, so that no earlier test's compiles hide one. The shapes make start-up's own prefills (the step-memory
reservation: 9 rows of 512 tokens, 32 query heads) take the long query tile, so that the default tile, which the
mixed steps' short chunks take, is compiled only if start-up compiles it on purpose."""
import json
import subprocess
import sys
from pathlib import Path

from offload_engine.tiny_model import build_tiny_model
from tests.conftest import PARITY_SHAPE, requires_cuda
from tests.oracle import random_prompts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
import triton
from offload_engine import LLM, SamplingParams

compiled, phase = [], ["start-up"]
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append((phase[0], kw["fn"].name)) and None
llm = LLM(sys.argv[1], device="cuda", kv_placement="auto", num_gpu_blocks=300, num_cpu_blocks=256, cpu_block_size=16,
          max_model_len=512)
phase[0] = "generate"
llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True), use_tqdm=False)
llm.close()
print("COMPILED " + json.dumps([name for when, name in compiled if when == "generate"]))
"""


@requires_cuda
def test_a_first_generate_compiles_no_kernel(tmp_path):
    model = build_tiny_model(str(tmp_path / "qwen3"), "qwen3", seed=5, with_tokenizer=False,
                             **{**PARITY_SHAPE, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128})
    prompts = random_prompts((470, 31, 170, 5, 90, 260, 12, 400, 455, 380, 420, 300, 466, 333, 410, 390), 256, seed=83)
    result = subprocess.run([sys.executable, "-c", SCRIPT, model, json.dumps(prompts)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("COMPILED "))
    assert json.loads(line.removeprefix("COMPILED ")) == []
