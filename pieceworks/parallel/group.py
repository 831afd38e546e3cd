"""Process groups of a tensor-parallel run and how a launch finds its rank.

Two groups: the device group (NCCL on CUDA, gloo on CPU) runs the models' collectives
(`parallel.comm`); a gloo group carries the leader's step messages (host objects), so that a step's
inputs never make a round trip through GPU memory. The control group has a timeout of its own (days):
a follower waits for the next step as long as the leader idles.

Under `torchrun`, the rank and world size come from torchrun's rendezvous variables (RANK, WORLD_SIZE,
LOCAL_RANK), read by `pieceworks.environment` for `torchrun_rank`; everywhere else the launcher passes
them explicitly.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pieceworks.environment import torchrun_variables
from pieceworks.errors import ConfigError

# Followers wait for the leader's next step as long as the leader idles (a server between requests):
# the control group's timeout bounds only a step message already under way, not the wait for one.
CONTROL_TIMEOUT = datetime.timedelta(days=7)


def torchrun_rank(tensor_parallel_size: int) -> tuple[int, int] | None:
    """(rank, local rank) when this process was started by torchrun, else None.

    Raises:
        ConfigError: torchrun's world size is not `parallel.tensor_parallel_size`, or its variables
            are not integers.
    """
    found = torchrun_variables()
    if found is None:
        return None
    rank, world, local_rank = found
    if world != tensor_parallel_size:
        raise ConfigError(f"parallel.tensor_parallel_size: {tensor_parallel_size}, but torchrun started {world} "
                          f"processes; run torchrun --nproc-per-node {tensor_parallel_size}, or set "
                          f"parallel.tensor_parallel_size={world}")
    return rank, local_rank


@dataclass
class ProcessGroups:
    """This rank's groups. `device_group` is the name the models' collectives take."""

    rank: int
    size: int
    device_group: str
    control: Any  # torch.distributed.ProcessGroup

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank (the leader passes it, the others get it)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_groups(rank: int, size: int, device: torch.device, init_method: str, timeout_s: float) -> ProcessGroups:
    """Join the run: `init_method` is torch.distributed's (env:// under torchrun, file:// for workers
    started in-process); collectives that wait longer than `timeout_s` fail instead of hanging."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size, timeout=timeout,
                                device_id=device)
    else:
        # N ranks share the cores: each takes its share of threads (a collective waits for the slowest
        # rank, and oversubscribed OpenMP threads spin against each other)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ProcessGroups(rank, size, dist.group.WORLD.group_name, control)
