"""A shared-memory all-reduce for the ranks of one host, behind the group's all_reduce (allreduce.c).

gloo's all-reduce of a decode step's few kilobytes costs one to two milliseconds here; ranks that share
a machine copy their tensor into a slot of one /dev/shm segment and each sum every slot, in rank order
(the same bits on every rank). Larger tensors, other devices or ranks on several hosts go to gloo.
"""

from __future__ import annotations

import ctypes
import os
from multiprocessing import resource_tracker, shared_memory

import torch

CAPACITY_FLOATS = 1 << 20  # per slot: a prompt chunk's [tokens, hidden] up to 4 MiB; larger ones use gloo
LINE = 64


class SharedMemoryAllReduce:
    def __init__(self, rank: int, world: int, segment: shared_memory.SharedMemory, owner: bool, lib):
        self.rank, self.world, self.segment, self.owner, self.lib = rank, world, segment, owner, lib
        self._calls = ctypes.c_int64(0)  # shared with the decode backend's C all-reduces (kernels/decode.c)
        self._view = ctypes.c_char.from_buffer(segment.buf)  # an export of the mapping: dropped before close
        self.address = ctypes.addressof(self._view)

    @classmethod
    def connect(cls, rank: int, world: int, broadcast) -> SharedMemoryAllReduce | None:
        """Every rank of a one-host job calls this together; None (every rank alike) where it cannot be used.

        `broadcast(obj)` is the group's: rank 0 makes the segment and tells the others its name."""
        from kvlab.kernels import gemv

        gemv._ensure_loaded()
        lib = gemv._comm.get("allreduce")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == world
        if not broadcast(bool(lib) and local and os.environ.get("KVLAB_SHM_ALLREDUCE", "1") != "0"):
            return None  # rank 0's answer for everyone: all ranks take the same path
        size = world * LINE + 2 * world * CAPACITY_FLOATS * 4
        segment = shared_memory.SharedMemory(create=True, size=size) if rank == 0 else None
        name = broadcast(segment.name if segment else None)
        if segment is None:
            segment = shared_memory.SharedMemory(name=name)
            resource_tracker.unregister(segment._name, "shared_memory")  # rank 0 owns it and unlinks it
        else:
            segment.buf[: world * LINE] = bytes(world * LINE)  # every rank's call counter at 0
        broadcast(None)  # everyone attached: rank 0 could unlink the name now, the mapping stays
        return cls(rank, world, segment, rank == 0, lib)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.numel() <= CAPACITY_FLOATS

    def all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> bool:
        """Sum `tensor` over the ranks in place; False when a rank did not arrive within `timeout_s`."""
        data = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._calls.value += 1
        status = self.lib(self.address, self.rank, self.world, CAPACITY_FLOATS, data.data_ptr(), data.numel(),
                          self._calls.value, timeout_s)  # fmt: skip
        if data is not tensor:
            tensor.copy_(data)
        return status == 0

    @property
    def calls(self) -> int:
        """All-reduces made so far (each call's number is its sequence in the segment)."""
        return self._calls.value

    def calls_address(self) -> int:
        """Where the counter lives, for C callers that make the same calls (the decode backend)."""
        return ctypes.addressof(self._calls)

    def close(self) -> None:
        del self._view
        self.segment.close()
        if self.owner:
            self.segment.unlink()
