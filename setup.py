from setuptools import find_packages, setup


def flash_attn_4() -> str:
    """flash-attn 4 with the CUTLASS DSL libraries for the CUDA that torch was built with, where torch is importable
    while this runs (an install without build isolation, as the Makefile's); else its default, CUDA 12's."""
    try:
        import torch

        major = int((torch.version.cuda or "12").split(".")[0])
    except ImportError:
        major = 12
    return "flash-attn-4[cu13]" if major >= 13 else "flash-attn-4"


setup(
    name="offload-engine",
    version="0.1.0",
    description="LLM inference with a GPU KV tier and a pinned-host KV tier attended on the CPU",
    packages=find_packages(include=["offload_engine*", "cpu_attention*", "gpu_kernels*"]),
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
    extras_require={"test": ["pytest"], "flash-attn": [flash_attn_4()], "flash-attn-cu12": ["flash-attn-4"],
                    "flash-attn-cu13": ["flash-attn-4[cu13]"]},
    entry_points={"console_scripts": ["offload-engine=offload_engine.cli:main"]},
)
