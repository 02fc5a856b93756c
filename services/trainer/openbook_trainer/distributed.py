"""Data-parallel training across processes: ``torch.distributed`` as launched by ``torchrun``.

``openbook train`` runs unchanged under ``torchrun --nproc_per_node N [--nnodes M ...]``:
torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address; this module
turns them into a :class:`World`. Without them the world is one process and nothing here
communicates (no process group is created).

The division of work (invariants the trainer relies on):

* Every rank computes the same global micro-batch (``batch_at`` is a pure function of the
  cursor) and takes its part :meth:`World.part` — so the global batch, the batch order and the
  learning-rate schedule do not depend on the world size.
* Gradients are averaged by DDP; each rank scales its summed loss so that the average is the
  mean over the *global* micro-batch (:meth:`World.loss_weight`), as one process computes it.
* Collectives time out after ``timeout`` (``--dist-timeout``): a rank that dies or stalls makes
  the others fail with an error instead of waiting forever (torchrun then stops the job).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# torchrun's environment (torch.distributed.run); all of them or none
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """The process group cannot be set up, or the ranks disagree; the message says how."""


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes checkpoints, logs and progress bars."""
        return self.rank == 0

    # ------------------------------------------------------------------ division of work

    def part(self, batch: Sequence[T]) -> tuple[list[T], bool]:
        """This rank's rows of a global micro-batch, and whether they count.

        Rows are dealt round-robin (rank r takes rows r, r+W, ...). When the batch has fewer
        rows than there are ranks (the end of an epoch), a rank left without rows still runs
        one row with weight 0: DDP needs every rank in every backward pass.
        """
        mine = list(batch[self.rank :: self.world_size])
        if mine:
            return mine, True
        return [batch[0]], False

    def loss_weight(self, global_rows: int) -> float:
        """Factor for this rank's *summed* loss so that DDP's average over the ranks is the
        mean over the ``global_rows`` rows of the global micro-batch."""
        return self.world_size / global_rows

    # ------------------------------------------------------------------ collectives

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks (float64 on the CPU: exact for losses and counts)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t)
        return float(t.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (picklable objects)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def from_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0, its result given to every rank. When it raises, every rank
        raises that error: the others would otherwise wait for rank 0 until the timeout."""
        if not self.distributed:
            return fn()
        result: Any = None
        error: Exception | None = None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # re-raised below, on every rank
                error = e
        shared_result, shared_error = self.broadcast((result, error))
        if error is not None:
            raise error
        if shared_error is not None:
            raise shared_error
        return shared_result

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def agree(self, what: str, value: Any) -> None:
        """Raise on every rank unless every rank has the same ``value`` (e.g. a data hash):
        ranks that silently train on different inputs would average meaningless gradients."""
        values = self.gather(value)
        if any(v != values[0] for v in values):
            differ = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise DistributedError(f"the ranks disagree on {what} ({differ})")

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _collective_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_from_env(device: str | None, timeout_s: float) -> World:
    """The world torchrun describes in the environment, with its process group initialised.

    ``device``: the configured device (None: CUDA when available). On CUDA every rank uses
    ``cuda:LOCAL_RANK`` and NCCL; on the CPU, gloo.
    """
    present = [k for k in _ENV if k in os.environ]
    if not present or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return World()
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise DistributedError(
            f"incomplete torch.distributed environment: {', '.join(missing)} unset "
            "(launch with torchrun, which sets them all)"
        )
    try:
        world = World(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
        )
    except ValueError as e:
        raise DistributedError(f"torch.distributed environment: {e}") from None
    if not 0 <= world.rank < world.world_size:
        raise DistributedError(f"RANK={world.rank} is outside WORLD_SIZE={world.world_size}")
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cuda:
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            timeout=dt.timedelta(seconds=timeout_s),
        )
    return world


def rank_device(world: World, device: str | None) -> str | None:
    """The device this rank trains on: ``cuda:LOCAL_RANK`` when the run is on CUDA."""
    if not world.distributed:
        return device
    if device is None and torch.cuda.is_available():
        device = "cuda"
    if device == "cuda":
        return f"cuda:{world.local_rank}"
    if device is not None and device.startswith("cuda:"):
        raise DistributedError(
            f"--device {device} under torchrun: every rank would share one GPU; use --device "
            "cuda (rank r trains on cuda:LOCAL_RANK)"
        )
    return device
