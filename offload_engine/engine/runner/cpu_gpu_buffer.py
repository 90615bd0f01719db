"""Named pinned host tensors and their device twins, packed so that one non-blocking copy moves them all.

The device side's typed views never move: the device lane's graphs read them as static inputs. The host side is
double-buffered (HOST_COPIES), since this step's copy may still be queued while the next step's inputs are written; a
copy into the one device side is ordered after the step that last read it. Why: docs/decisions/device-lane.md.
"""
import numpy as np
import torch

HOST_COPIES = 2
_ALIGN = 64


class PackedCpuGpuBuffers:
    def __init__(self, fields: dict[str, tuple[int, torch.dtype, float]], device: torch.device):
        """fields: name -> (length, dtype, initial value), in the order they are packed; the last one may be
        copied in part (copy_to_device's `last_used`)."""
        self.offsets, self.fields, offset = {}, fields, 0
        for name, (length, dtype, _) in fields.items():
            self.offsets[name] = offset
            offset += -(-length * dtype.itemsize // _ALIGN) * _ALIGN
        pin = device.type == "cuda"
        self.device_bytes = torch.empty(offset, dtype=torch.uint8, device=device)
        self.host_bytes = [torch.empty(offset, dtype=torch.uint8, pin_memory=pin) for _ in range(HOST_COPIES)]
        self.device = {name: self._view(self.device_bytes, name) for name in fields}
        self.hosts = [{name: self._view(host, name).numpy() for name in fields} for host in self.host_bytes]
        for name, (_, _, fill) in fields.items():
            self.device[name].fill_(fill)
            for host in self.hosts:
                host[name][:] = fill

    def _view(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        length, dtype, _ = self.fields[name]
        start = self.offsets[name]
        return raw[start:start + length * dtype.itemsize].view(dtype)

    def host(self, parity: int, name: str) -> np.ndarray:
        """The numpy view of one field in host half `parity` (the step's number mod HOST_COPIES)."""
        return self.hosts[parity][name]

    def copy_to_device(self, parity: int, last_used: int) -> None:
        """One copy of host half `parity`: every field, and the first `last_used` entries of the last one."""
        name = next(reversed(self.fields))
        end = self.offsets[name] + last_used * self.fields[name][1].itemsize
        self.device_bytes[:end].copy_(self.host_bytes[parity][:end], non_blocking=True)
