"""How many hardware work queues CUDA spreads the process's streams over, and why the engine asks for 32.

CUDA maps every stream onto one of CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 unless set), read once,
when the process creates its CUDA context. Work in one queue runs in order, whichever stream it came from. The
host lane's whole-step graphs hold their stream at a gate while the host kernel runs each layer
(engine/graphs/host_step_graphs.py), so a device-lane stream that shares that queue holds too. With 8 queues the device
lane's prefills did: on the H100 host (2026-11-22, one call, decode-heavy 0.6B at 1/4 of its KV) device-tier
prefill steps took 212 ms each against 54 under "gpu", and "auto" made 0.96x "gpu"; with 32 queues, 81 ms and
1.02x. 32 is the most CUDA allows.
"""
import os
import sys
import warnings

QUEUES = "32"


def widen_hardware_queues() -> None:
    """Sets CUDA_DEVICE_MAX_CONNECTIONS=32 for this process unless the user chose a value. It takes effect only
    if no CUDA context exists yet, which is why the package does it on import."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return  # too late for this process; warn_if_narrow says so where it matters
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = QUEUES


def warn_if_narrow() -> None:
    """Warns, once per engine with a host tier on CUDA, when the setting may not have reached the CUDA context."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is None:
        warnings.warn("CUDA was initialized before offload_engine was imported, so CUDA_DEVICE_MAX_CONNECTIONS "
                      "stays at CUDA's default of 8: the device lane may wait behind the host lane's gates. Import "
                      "offload_engine first, or set CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment.", stacklevel=3)
    elif not value.isdigit() or int(value) < int(QUEUES):
        warnings.warn(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: with fewer than {QUEUES} hardware queues the device "
                      "lane may wait behind the host lane's gates (engine/graphs/hardware_queues.py).", stacklevel=3)
