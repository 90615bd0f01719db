"""Materializes a model directory with random weights at a real model's shape (configs/ holds the shapes).

No weights can be downloaded here, and throughput does not depend on weight values: random bf16 weights at
the published dimensions are the standard way to measure it. The directory is a normal Hugging Face one
(config.json + model.safetensors), built by transformers, so the engine loads it through its real loader.
"""
import argparse
import json
import os
import shutil

import torch

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def materialize(name: str, out_dir: str, device: str = "cuda" if torch.cuda.is_available() else "cpu") -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(out_dir, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        raw = json.load(f)
    os.makedirs(path + ".partial", exist_ok=True)
    with open(os.path.join(path + ".partial", "config.json"), "w") as f:
        json.dump(raw, f)
    config = AutoConfig.from_pretrained(path + ".partial")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path + ".partial", safe_serialization=True)
    del model
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".partial", path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", help="a config in benchmarks/configs, e.g. qwen3-0.6b")
    parser.add_argument("--out-dir", default="/tmp/offload_engine_models")
    print(materialize(**vars(parser.parse_args())))
