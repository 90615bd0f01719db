"""Shared test setup.

Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it has to be set before anything imports `kernels`.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
