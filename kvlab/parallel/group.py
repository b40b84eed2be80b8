"""The tensor-parallel group: every rank of a torchrun job, over torch.distributed (gloo on CPU, NCCL on CUDA).

    group = TPGroup.from_environment(tensor_parallel_size=2)   # WORLD_SIZE, RANK, ... set by torchrun
    y = group.all_reduce(partial)          # the sum of every rank's tensor, on every rank
    logits = group.all_gather(shard, -1)   # every rank's shard, concatenated along a dimension
    events = group.broadcast(events)       # rank 0's Python object, on every rank

Ranks on one host all-reduce through shared memory (parallel/shm.py: gloo's round trips cost most of
a decode step here); everything else goes through torch.distributed. Every collective has a deadline (`timeout_s`): a rank that died or hangs ends the job with a one-line
error instead of leaving the others waiting forever. A world of one (no torchrun) is a group too:
its collectives return their input, so the same code runs with and without tensor parallelism.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field

import torch

from kvlab.errors import KvlabError

DEFAULT_TIMEOUT_S = 60.0


class RankFailed(KvlabError):
    """Another rank of the job died or stopped answering: this one cannot go on either."""


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # seconds spent in collectives since the last `take_comm_seconds` (the benchmark's all-reduce share)
    comm_s: float = 0.0
    num_collectives: int = 0
    shm: object = None  # the shared-memory all-reduce, when every rank is on this host (parallel/shm.py)

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @classmethod
    def from_environment(cls, tensor_parallel_size: int, device="cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """The group torchrun launched this process into; its world size must be `tensor_parallel_size`."""
        device = torch.device(device)
        if launch_rank(tensor_parallel_size) is None:
            return cls(device=device, timeout_s=timeout_s)
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
            try:
                dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
            except RuntimeError as e:  # the rendezvous: a rank that never came (DistStoreError is one)
                raise RankFailed(f"rank {os.environ.get('RANK', '?')}: joining the tensor-parallel job failed "
                                 f"({str(e).splitlines()[0][:200]}) within {timeout_s:g} s") from None  # fmt: skip
        group = cls(rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s, device=device)
        if device.type == "cpu":
            from kvlab.parallel.shm import SharedMemoryAllReduce

            group.shm = SharedMemoryAllReduce.connect(group.rank, group.world_size, group.broadcast)
        return group

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that prints, serves HTTP and decides what every rank does next."""
        return self.rank == 0

    # ---- collectives -------------------------------------------------------------------------------

    def _run(self, what: str, fn):
        start = time.perf_counter()
        try:
            return fn()
        except RuntimeError as e:  # gloo/NCCL: a peer closed its connection, or the deadline passed
            raise RankFailed(
                f"rank {self.rank}: {what} failed ({str(e).splitlines()[0][:200]}): another rank of the "
                f"tensor-parallel job died or stopped answering within {self.timeout_s:g} s; the job ends"
            ) from None
        finally:
            self.comm_s += time.perf_counter() - start
            self.num_collectives += 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over ranks, in place (and returned)."""
        if self.world_size == 1:
            return tensor
        if self.shm is not None and self.shm.fits(tensor):
            return self._run("all-reduce", lambda: self._shm_all_reduce(tensor))
        import torch.distributed as dist

        return self._run("all-reduce", lambda: dist.all_reduce(tensor) or tensor)

    def _shm_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.shm.all_reduce(tensor, self.timeout_s):
            raise RuntimeError("a rank did not reach the shared-memory all-reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor (all the same shape), concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all-gather", lambda: dist.all_gather(parts, tensor))
        return torch.cat(parts, dim=dim)

    def broadcast(self, obj=None):
        """Rank 0's `obj` (any picklable object), returned on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value`, on every rank (a size each of them can hold)."""
        if self.world_size == 1:
            return value
        return int(self.all_gather(torch.tensor([value], dtype=torch.int64, device=self.device), 0).min())

    def take_comm_seconds(self) -> tuple[float, int]:
        """(seconds in collectives, how many) since the last call."""
        out = (self.comm_s, self.num_collectives)
        self.comm_s, self.num_collectives = 0.0, 0
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def launch_rank(tensor_parallel_size: int, api: bool = False) -> int | None:
    """This process's rank in the torchrun job that `tensor_parallel_size` asks for; None for a plain
    process (a size of 1 outside torchrun). Reads only torchrun's variables (RANK, WORLD_SIZE), so it
    answers before anything slow; a launch that does not match is a KvlabError saying how to launch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    flag, command = ("tensor_parallel_size=", "SCRIPT.py") if api else ("--tensor-parallel-size ", "-m kvlab ...")
    if tensor_parallel_size < 1:
        raise KvlabError(f"{flag.strip()} must be at least 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1 and world == 1:
        return None
    if world == 1:
        raise KvlabError(
            f"{flag}{tensor_parallel_size} needs {tensor_parallel_size} processes: launch with "
            f"torchrun --nproc-per-node {tensor_parallel_size} {command} (or python -m torch.distributed.run)"
        )
    if world != tensor_parallel_size:
        raise KvlabError(f"{flag}{tensor_parallel_size} does not match the {world} processes torchrun launched "
                         f"(WORLD_SIZE={world}): give {flag}{world}, or launch {tensor_parallel_size}")  # fmt: skip
    return int(os.environ.get("RANK", "0"))


def collective_timeout_s() -> float:
    """The collectives' deadline: $KVLAB_TP_TIMEOUT_S seconds, or DEFAULT_TIMEOUT_S."""
    text = os.environ.get("KVLAB_TP_TIMEOUT_S")
    try:
        value = DEFAULT_TIMEOUT_S if text is None else float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise KvlabError(f"KVLAB_TP_TIMEOUT_S must be a number of seconds above 0, got {text!r}")
    return value
