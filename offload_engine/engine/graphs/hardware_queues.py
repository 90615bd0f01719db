"""CUDA_DEVICE_MAX_CONNECTIONS, the hardware work queues CUDA spreads the process's streams over: the engine asks for
32 (the most CUDA allows; 8 unless set), since a device-lane stream sharing a queue with a host-lane graph held at a
gate waits too (docs/decisions/lane-interference.md, "Hardware queues").
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
