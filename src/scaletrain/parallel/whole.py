"""The whole model's tensors, one at a time, wherever the processes hold them (the main process's whole model,
pipeline stages, fsdp shards): what a weights file is written from tensor by tensor (runfolder.save_weights), so
that no process holds more than its own part and one tensor, none of it on a GPU.

Every process iterates `specs` and calls `read(name)` in that order; the main process gets each tensor whole on
the CPU, the others send it their pieces (over gloo: the default group on CPUs, a gloo group beside NCCL on GPUs)
and get None; a tensor-parallel split is gathered by DTensor among the processes that hold its parts (on the
device, one tensor at a time), the first of them sending it on. Tensors the main process holds whole (a model not
split) need none of this: their state dict is what runfolder.save_weights reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .materialise import cut_from_whole, shard_rows
from .watch import BEAT


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class WholeTensors:
    """The whole model's state, tensor by tensor (see the module's doc)."""

    def __init__(self, specs: list[Spec], read):
        self.specs = specs
        self._read = read

    def read(self, name: str) -> torch.Tensor | None:
        return self._read(name)

    @classmethod
    def gathered(cls, runtime, state: dict[str, torch.Tensor]) -> "WholeTensors | dict[str, torch.Tensor]":
        """The tensors of this process's state (a stage's whole tensors, an fsdp shard's rows) and of every other
        process's, as one model's. A collective: every process calls it, then reads in order. On one process, the
        state itself."""
        import torch.distributed as dist

        if runtime.world_size == 1:
            return state
        cut = {k for k, t in state.items() if cut_from_whole(t)}  # tensor-parallel splits: gathered by DTensor
        held = {k: (t, None if k in cut else shard_rows(t)) for k, t in state.items()}
        mine = [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), rows) for k, (t, rows) in held.items()]
        every: list = [None] * runtime.world_size
        with BEAT.during("collective"):
            dist.all_gather_object(every, mine)
        kinds: dict[str, Spec] = {}
        whole_at: dict[str, int] = {}  # held whole (by each replica of a stage, by each fsdp process): the first sends
        rows_at: dict[str, list[tuple[int, tuple[int, int]]]] = {}  # held as rows: every process sends its own
        for rank, entries in enumerate(every):
            for name, dtype, shape, rows in entries:  # a DTensor's shape is the whole tensor's
                kinds.setdefault(name, Spec(name, getattr(torch, dtype), tuple(shape)))
                if rows is None:
                    whole_at.setdefault(name, rank)
                elif rows[1] > rows[0]:
                    rows_at.setdefault(name, []).append((rank, tuple(rows)))
        pieces = {name: [(whole_at[name], None)] if name in whole_at else rows_at.get(name, []) for name in kinds}
        group = runtime.cpu_group()
        me = runtime.rank

        def read(name: str) -> torch.Tensor | None:
            spec = kinds[name]
            whole = None
            if name in cut:  # each process of the split takes part in its gather; the first of them sends it on
                with BEAT.during("collective"):
                    whole = held[name][0].full_tensor().detach().cpu()
            out = torch.empty(spec.shape, dtype=spec.dtype) if me == 0 else None
            with BEAT.during("collective"):
                for rank, rows in pieces[name]:
                    if rank == me:
                        local = held[name][0] if whole is None else whole
                        local = (local.to_local() if hasattr(local, "to_local") else local).detach().cpu()
                        if me == 0:
                            (out if rows is None else out[rows[0]:rows[1]]).copy_(local)
                        else:
                            dist.send(local.contiguous(), dst=0, group=group)
                    elif me == 0:
                        dist.recv(out if rows is None else out[rows[0]:rows[1]], src=rank, group=group)
            return out

        return cls([kinds[k] for k in sorted(kinds)], read)
