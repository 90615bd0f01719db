from setuptools import find_packages, setup

setup(
    name="offload-engine",
    version="0.1.0",
    description="LLM inference with a GPU KV tier and a pinned-host KV tier attended on the CPU",
    packages=find_packages(include=["offload_engine*", "cpu_attention*", "kernels*"]),
    python_requires=">=3.10",
    # torch is not listed: the Makefile installs the right build (CPU-only where there is no NVIDIA GPU),
    # and a bare `torch` requirement would pull a multi-GB CUDA build onto CPU-only machines.
    install_requires=[
        "triton>=3.4",
        "transformers>=4.51",
        "tokenizers",  # read directly: tokenizer.json without importing transformers
        "safetensors",
        "numpy",
        "numba>=0.60",
        "psutil",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"test": ["pytest"], "flash-attn": ["flash-attn"]},
    entry_points={"console_scripts": ["offload-engine=offload_engine.cli:main"]},
)
