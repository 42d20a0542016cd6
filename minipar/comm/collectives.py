"""Collectives that know about autograd, and the ledger of every byte sent.

What this file teaches, in two parts.

1. The ledger. Every MPI call minipar makes goes through `Group`, a thin
   wrapper with mpi4py's own method names (`group.Allreduce(MPI.IN_PLACE, buf)`
   reads exactly like `comm.Allreduce`), which records `(op, group, calls,
   elements, bytes)` before calling MPI. `elements` is the size of the whole
   buffer the operation is defined on: Allreduce the buffer, Allgather the
   gathered result, Reduce_scatter the input before scattering, Alltoall(v)
   what this rank sends (its own chunk included), Send/Recv the message.
   Lessons turn it into wire volume with the ring formulas (`wire_elements`).

2. Megatron's conjugate operators (Megatron-LM, Shoeybi et al. 2019): a
   collective inside the model is an autograd op whose backward is another
   collective. Each pair, forward / backward:

       copy_to          identity        / Allreduce(SUM)
       reduce_from      Allreduce(SUM)  / identity
       scatter_to       split           / Allgather
       gather_from      Allgather       / split
       reduce_scatter   Reduce_scatter  / Allgather
       all_gather       Allgather       / Reduce_scatter
       sum_replicated   Allreduce(SUM)  / Allreduce(SUM)
       alltoallv        Alltoallv       / Alltoallv reversed

   On a group of one they communicate nothing, so a strategy with degree 1
   runs the reference math exactly.

3. Placements (placement/__init__.py). Each operator is a transition of the placement of
   its tensor over the group's axis, checked when placement checking is on (the
   backward makes the conjugate transition, the other way round):

       copy_to          Replicate -> Replicate, its gradient Partial -> Replicate
       reduce_from      Partial -> Replicate        (its gradient stays Replicate)
       sum_replicated   Partial -> Replicate        (its gradient Partial -> Replicate)
       scatter_to(d)    Replicate -> Shard(d)       (its gradient Shard(d) -> Replicate)
       gather_from(d)   Shard(d) -> Replicate       (its gradient Replicate -> Shard(d))
       reduce_scatter   Partial -> Shard(0)         (its gradient Shard(0) -> Replicate)
       all_gather       Shard(0) -> Replicate, its gradient Partial -> Shard(0)
       alltoallv        Shard(0) -> Shard(0)        rows regrouped; no Partial may travel

   The array helpers below carry no placement: the gradient syncs that call them
   state theirs with `placement.summed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from minipar import placement
from minipar.comm import flight, trace, watchdog
from minipar.core import precision
from minipar.core.autograd import Tensor
from minipar.placement import Partial, Replicate, Shard


# ------------------------------------------------------------------ ledger
@dataclass
class Entry:
    """The totals of one (op, group) pair."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0


class Ledger:
    """Counts calls, elements and bytes per (op, group) on this rank."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Entry] = {}
        self.enabled = True

    def record(self, op: str, group: str, elements: int, itemsize: int) -> None:
        if not self.enabled:
            return
        entry = self.entries.setdefault((op, group), Entry())
        entry.calls += 1
        entry.elements += int(elements)
        entry.bytes += int(elements) * int(itemsize)

    def reset(self) -> None:
        self.entries = {}

    def records(self, rank: int) -> list[dict]:
        """This rank's entries in the `ledger.json` format (docs/design.md, "The train
        command")."""
        return [{"rank": rank, "op": op, "group": group, "calls": e.calls,
                 "elements": e.elements, "bytes": e.bytes}
                for (op, group), e in sorted(self.entries.items())]

    def total(self, op: str | None = None, group: str | None = None,
              field: str = "elements") -> int:
        """Sum of `field` over the entries matching `op` and `group` (None = any)."""
        return sum(getattr(e, field) for (o, g), e in self.entries.items()
                   if (op is None or o == op) and (group is None or g == group))


def _size(buf: object) -> tuple[int, int]:
    """(elements, itemsize) of a buffer argument: an array, or an mpi4py buffer spec
    `[array, counts, displacements, type]` (or `[array, (counts, displacements), type]`),
    where what moves is the sum of the counts, not the whole array."""
    if buf is None:  # a pickled object: a call, no elements
        return 0, 1
    if not isinstance(buf, (list, tuple)):
        array = np.asarray(buf)
        return array.size, array.itemsize
    array = np.asarray(buf[0])
    counts = buf[1] if len(buf) > 1 and not isinstance(buf[1], MPI.Datatype) else None
    if isinstance(counts, tuple) and len(counts) == 2 and np.ndim(counts[0]) == 1:
        counts = counts[0]  # (counts, displacements)
    elements = array.size if counts is None else int(np.sum(counts))
    return elements, array.itemsize


def _moved(buf: object) -> object:
    """A buffer argument as MPI is handed it: a 16-bit array (--mixed) as its uint16
    view, also as the first entry of a buffer spec (whose datatype becomes uint16);
    anything else as it is. Only for calls that move bytes: a sum must know the format
    (comm/low_precision.py), so `_summed` refuses a 16-bit buffer under a built-in op."""
    if isinstance(buf, np.ndarray):
        return precision.wire(buf)
    if isinstance(buf, (list, tuple)) and buf and isinstance(buf[0], np.ndarray) \
            and precision.is_low(buf[0].dtype):
        return [buf[0].view(np.uint16)] + [MPI.UINT16_T if isinstance(b, MPI.Datatype)
                                           else b for b in buf[1:]]
    return buf


def _summed(buf: object, op: MPI.Op) -> object:
    """A buffer of a reduction: a 16-bit array may only meet a user-defined operation
    (low_precision.low_sum_op, handed its uint16 view): MPI.SUM on its words would add
    bit patterns, not numbers."""
    if isinstance(buf, np.ndarray) and precision.is_low(buf.dtype):
        raise TypeError("a 16-bit buffer cannot be reduced with a built-in MPI operation: "
                        "upcast it, or sum it in 16 bits (comm/low_precision.py)")
    return buf


# ------------------------------------------------------------------ group
class Group:
    """An MPI communicator for one mesh axis that writes every call into the ledger.

    The methods keep mpi4py's names and arguments, so call sites read as plain
    mpi4py; `comm` is the raw communicator for anything else. Each call goes through
    `_call`: the ledger and the flight recorder (`_log`), the watchdog's stamp on a
    blocking call (`watchdog.waiting`: what it is and since when), and the timeline of
    a traced run (trace.py).
    """

    def __init__(self, comm: MPI.Comm, name: str, ledger: Ledger) -> None:
        self.comm = comm
        self.name = name
        self.ledger = ledger
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    def _log(self, op: str, buf: object, *detail: object) -> None:
        """Count the call in the ledger and keep it in the flight recorder (flight.py;
        `detail`: the peer and tag of a message, the two buffers of an Alltoallv)."""
        elements, itemsize = _size(buf)
        self.ledger.record(op, self.name, elements, itemsize)
        flight.record(self, op, elements, itemsize, detail)

    def _call(self, op: str, buf: object, what: str | None = None, detail: tuple = (),
              dest: int | None = None, source: int | None = None, tag: int = 0,
              recvtag: int = 0) -> contextlib.AbstractContextManager:
        """Around every call: `_log` it (ledger, flight recorder), stamp it for the
        watchdog if it blocks (`what`), and time it when the run is traced (trace.py: one
        span per call, a nonblocking one open until its Wait)."""
        self._log(op, buf, *detail)
        recorder = trace.RECORDER
        if recorder is None:
            return watchdog.waiting(what) if what is not None else trace.NOTHING
        elements, itemsize = _size(buf)
        return recorder.call(self, op, elements, itemsize, what, dest, source, tag, recvtag)

    # collectives on arrays; recorded sizes follow the ledger convention
    def Allreduce(self, sendbuf: object, recvbuf: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        with self._call("Allreduce", recvbuf, f"Allreduce over {self.name}"):
            self.comm.Allreduce(_summed(sendbuf, op), _summed(recvbuf, op), op=op)

    def Iallreduce(self, sendbuf: object, recvbuf: np.ndarray,
                   op: MPI.Op = MPI.SUM) -> MPI.Request:
        with self._call("Iallreduce", recvbuf) as call:
            request = self.comm.Iallreduce(_summed(sendbuf, op), _summed(recvbuf, op), op=op)
        return trace.posted(call, request)

    def Allgather(self, sendbuf: object, recvbuf: object) -> None:
        with self._call("Allgather", recvbuf, f"Allgather over {self.name}"):
            self.comm.Allgather(_moved(sendbuf), _moved(recvbuf))

    def Allgatherv(self, sendbuf: object, recvbuf: object) -> None:
        with self._call("Allgatherv", recvbuf, f"Allgatherv over {self.name}"):
            self.comm.Allgatherv(_moved(sendbuf), _moved(recvbuf))

    def Reduce_scatter(self, sendbuf: object, recvbuf: object,
                       recvcounts: Sequence[int] | None = None, op: MPI.Op = MPI.SUM) -> None:
        with self._call("Reduce_scatter", recvbuf if sendbuf is MPI.IN_PLACE else sendbuf,
                        f"Reduce_scatter over {self.name}"):
            self.comm.Reduce_scatter(_summed(sendbuf, op), _summed(recvbuf, op), recvcounts,
                                     op=op)

    def Reduce_scatter_block(self, sendbuf: object, recvbuf: object,
                             op: MPI.Op = MPI.SUM) -> None:
        with self._call("Reduce_scatter", recvbuf if sendbuf is MPI.IN_PLACE else sendbuf,
                        f"Reduce_scatter_block over {self.name}"):
            self.comm.Reduce_scatter_block(_summed(sendbuf, op), _summed(recvbuf, op), op=op)

    def Alltoall(self, sendbuf: object, recvbuf: object) -> None:
        with self._call("Alltoall", recvbuf if sendbuf is MPI.IN_PLACE else sendbuf,
                        f"Alltoall over {self.name}"):
            self.comm.Alltoall(_moved(sendbuf), _moved(recvbuf))

    def Alltoallv(self, sendbuf: object, recvbuf: object) -> None:
        with self._call("Alltoallv", recvbuf if sendbuf is MPI.IN_PLACE else sendbuf,
                        f"Alltoallv over {self.name}", detail=(sendbuf, recvbuf)):
            self.comm.Alltoallv(_moved(sendbuf), _moved(recvbuf))

    def Exscan(self, sendbuf: object, recvbuf: object, op: MPI.Op = MPI.SUM) -> None:
        with self._call("Exscan", recvbuf, f"Exscan over {self.name}"):
            self.comm.Exscan(sendbuf, recvbuf, op=op)

    def Bcast(self, buf: object, root: int = 0) -> None:
        with self._call("Bcast", buf, f"Bcast over {self.name}"):
            self.comm.Bcast(_moved(buf), root=root)

    # point to point
    def Send(self, buf: object, dest: int, tag: int = 0) -> None:
        with self._call("Send", buf, f"Send to {self.name} rank {dest}", detail=(dest, tag),
                        dest=dest, tag=tag):
            self.comm.Send(_moved(buf), dest=dest, tag=tag)

    def Recv(self, buf: object, source: int, tag: int = 0) -> None:
        with self._call("Recv", buf, f"Recv from {self.name} rank {source}",
                        detail=(source, tag), source=source, recvtag=tag):
            self.comm.Recv(_moved(buf), source=source, tag=tag)

    def Isend(self, buf: object, dest: int, tag: int = 0) -> MPI.Request:
        with self._call("Isend", buf, detail=(dest, tag), dest=dest, tag=tag) as call:
            request = self.comm.Isend(_moved(buf), dest=dest, tag=tag)
        return trace.posted(call, request)

    def Irecv(self, buf: object, source: int, tag: int = 0) -> MPI.Request:
        with self._call("Irecv", buf, detail=(source, tag), source=source, recvtag=tag) as call:
            request = self.comm.Irecv(_moved(buf), source=source, tag=tag)
        return trace.posted(call, request)

    def Sendrecv(self, sendbuf: object, dest: int, recvbuf: object, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> None:
        with self._call("Sendrecv", sendbuf, f"Sendrecv with {self.name} ranks {dest}/{source}",
                        detail=(dest, source, sendtag), dest=dest, source=source, tag=sendtag,
                        recvtag=recvtag):
            self.comm.Sendrecv(_moved(sendbuf), dest=dest, sendtag=sendtag,
                               recvbuf=_moved(recvbuf),
                               source=source, recvtag=recvtag)

    # small Python objects (pickled): counted as calls with no elements
    def bcast(self, obj: object, root: int = 0) -> object:
        with self._call("bcast", None, f"bcast over {self.name}"):
            return self.comm.bcast(obj, root=root)

    def allgather(self, obj: object) -> list:
        with self._call("allgather", None, f"allgather over {self.name}"):
            return self.comm.allgather(obj)

    def gather(self, obj: object, root: int = 0) -> list | None:
        with self._call("gather", None, f"gather over {self.name}"):
            return self.comm.gather(obj, root=root)

    def Barrier(self) -> None:
        with self._call("Barrier", None, f"Barrier over {self.name}"):
            self.comm.Barrier()


# --------------------------------------------------- array helpers (no autograd)
def _summable(x: np.ndarray) -> np.ndarray:
    """What an MPI sum runs on: a 16-bit array upcast to the master dtype (partial sums
    are added in the master dtype and rounded once after: docs/design.md, "Mixed
    precision"); any other array as it is."""
    return x.astype(precision.MASTER or np.float32) if precision.is_low(x.dtype) else x


def allreduce_sum(group: Group, x: np.ndarray) -> np.ndarray:
    """Sum `x` over the group into a new array (a 16-bit x: summed in the master dtype,
    then rounded once)."""
    out = np.ascontiguousarray(_summable(x)).copy()
    if group.size > 1:
        group.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)  # x from every rank -> their sum
    return out.astype(x.dtype, copy=False)


def allgather_axis(group: Group, x: np.ndarray, axis: int) -> np.ndarray:
    """Concatenate every rank's `x` along `axis` (rank order)."""
    if group.size == 1:
        return x
    gathered = np.empty((group.size, *x.shape), dtype=x.dtype)
    # x (shape) -> (N, shape) on all (--mixed: 16-bit words)
    group.Allgather(precision.wire(np.ascontiguousarray(x)), precision.wire(gathered))
    return np.concatenate(list(gathered), axis=axis)


def split_axis(group: Group, x: np.ndarray, axis: int) -> np.ndarray:
    """This rank's equal piece of `x` along `axis` (no communication)."""
    if group.size == 1:
        return x
    return np.split(x, group.size, axis=axis)[group.rank].copy()


def reduce_scatter_rows(group: Group, x: np.ndarray, axis: int = 0) -> np.ndarray:
    """Sum `x` over the group and keep this rank's block along `axis` (rows by default;
    the transformer's sequence parallelism cuts positions, axis 1 of (B, T, d))."""
    if group.size == 1:
        return x
    front = np.ascontiguousarray(np.moveaxis(_summable(x), axis, 0))  # MPI cuts axis 0
    out = np.empty((front.shape[0] // group.size, *front.shape[1:]), dtype=front.dtype)
    group.Reduce_scatter_block(front, out, op=MPI.SUM)     # (N b, ..) -> (b, ..)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis)).astype(x.dtype, copy=False)


# ------------------------------------------------------- autograd collectives
def copy_to(x: Tensor, group: Group) -> Tensor:
    """Forward: identity. Backward: Allreduce(SUM) over the group.

    Megatron's f operator, at the input of a tensor-parallel region: every rank
    uses the same x, so x's gradient is the sum of every rank's contribution.
    Placement: Replicate -> Replicate whose gradient is summed (`grad_summed`)."""
    if group.size == 1:
        return x
    # exercise: conjugate-f-g
    out = Tensor.from_op(x.data, (x,),
                         lambda g: x.accumulate(allreduce_sum(group, g), fresh=True))
    # end exercise
    if placement.ON:
        placement.transition("copy_to", x, group, Replicate, Replicate(grad_summed=True), out)
    return out


def reduce_from(x: Tensor, group: Group) -> Tensor:
    """Forward: Allreduce(SUM) over the group. Backward: identity.

    Megatron's g operator, at the output of a row-parallel linear: partial sums
    become the full result; each rank's copy of the result gets the same gradient.
    Placement: Partial -> Replicate (a replicated input would be added tp times)."""
    if group.size == 1:
        return x
    # exercise: conjugate-f-g
    out = Tensor.from_op(allreduce_sum(group, x.data), (x,), lambda g: x.accumulate(g))
    # end exercise
    return placement.transition("reduce_from (an Allreduce)", x, group, Partial,
                                Replicate(), out) \
        if placement.ON else out


def sum_replicated(x: Tensor, group: Group) -> Tensor:
    """Forward: Allreduce(SUM). Backward: Allreduce(SUM).

    For a partial statistic (the MoE router's mean probability over a batch split
    across data-parallel ranks) whose sum is used by every rank, each rank seeding
    its own share of the loss: the sum's gradient is the sum of all ranks' gradients.
    Placement: Partial -> Replicate."""
    if group.size == 1:
        return x
    out = Tensor.from_op(allreduce_sum(group, x.data), (x,),
                         lambda g: x.accumulate(allreduce_sum(group, g), fresh=True))
    return placement.transition("sum_replicated (an Allreduce)", x, group, Partial,
                                Replicate(grad_summed=True), out) if placement.ON else out


def scatter_to(x: Tensor, group: Group, axis: int = -1) -> Tensor:
    """Forward: split along `axis`, keep this rank's piece. Backward: Allgather.
    Placement: Replicate -> Shard(axis)."""
    if group.size == 1:
        return x
    out = Tensor.from_op(split_axis(group, x.data, axis), (x,),
                         lambda g: x.accumulate(allgather_axis(group, g, axis), fresh=True))
    return placement.transition("scatter_to (a split)", x, group, Replicate,
                                Shard(axis % x.ndim), out) if placement.ON else out


def gather_from(x: Tensor, group: Group, axis: int = -1) -> Tensor:
    """Forward: Allgather along `axis`. Backward: split, keep this rank's piece.
    Placement: Shard(axis) -> Replicate."""
    if group.size == 1:
        return x
    out = Tensor.from_op(allgather_axis(group, x.data, axis), (x,),
                         lambda g: x.accumulate(split_axis(group, g, axis), fresh=True))
    return placement.transition("gather_from (an Allgather)", x, group, Shard(axis % x.ndim),
                                Replicate(), out) if placement.ON else out


def reduce_scatter(x: Tensor, group: Group, axis: int = 0) -> Tensor:
    """Forward: Reduce_scatter along `axis` (sum, keep my block). Backward: Allgather.

    Sequence parallelism's exit from a tensor-parallel region (Korthikanti et al. 2022):
    rows of the MLP's (B, d), positions (axis 1) of the transformer's (B, T, d).
    Placement: Partial -> Shard(axis)."""
    if group.size == 1:
        return x
    # the gradient comes back as an Allgather: 16-bit words under --mixed (its values
    # are 16-bit numbers even when x, a partial sum, was kept in the master dtype)
    out = Tensor.from_op(reduce_scatter_rows(group, x.data, axis), (x,),
                         lambda g: x.accumulate(allgather_axis(
                             group, precision.round_low(g), axis), fresh=True))
    return placement.transition("reduce_scatter (a Reduce_scatter)", x, group, Partial,
                                Shard(axis % x.ndim), out) if placement.ON else out


def all_gather(x: Tensor, group: Group, axis: int = 0) -> Tensor:
    """Forward: Allgather along `axis`. Backward: Reduce_scatter along `axis`.

    Sequence parallelism's entry into a tensor-parallel region.
    Placement: Shard(axis) -> Replicate whose gradient (a partial sum) is Reduce_scattered."""
    if group.size == 1:
        return x
    out = Tensor.from_op(allgather_axis(group, x.data, axis), (x,),
                         lambda g: x.accumulate(reduce_scatter_rows(group, g, axis),
                                                fresh=True))
    return placement.transition("all_gather (an Allgather)", x, group, Shard(axis % x.ndim),
                                Replicate(grad_summed=True), out) if placement.ON else out


def alltoallv_rows(group: Group, x: np.ndarray, send_counts: np.ndarray,
                   recv_counts: np.ndarray) -> np.ndarray:
    """Send `send_counts[j]` consecutive rows of `x` to rank j; receive `recv_counts[i]`
    rows from rank i, stacked in rank order. Counts are in rows; MPI wants elements."""
    width = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((int(recv_counts.sum()), *x.shape[1:]), dtype=x.dtype)
    send = np.ascontiguousarray(x)
    send_elems, recv_elems = send_counts * width, recv_counts * width
    send_displ = np.concatenate(([0], np.cumsum(send_elems)[:-1]))
    recv_displ = np.concatenate(([0], np.cumsum(recv_elems)[:-1]))
    kind = MPI._typedict[precision.wire(send).dtype.char]  # --mixed: 16-bit rows as uint16 words
    # rows for rank j -> rank j; rows from rank i land at recv_displ[i]
    group.Alltoallv([precision.wire(send), send_elems, send_displ, kind],
                    [precision.wire(out), recv_elems, recv_displ, kind])
    return out


def alltoallv(x: Tensor, group: Group, send_counts: np.ndarray,
              recv_counts: np.ndarray) -> Tensor:
    """Forward: Alltoallv of rows. Backward: Alltoallv with the counts swapped.

    The MoE dispatch (tokens to the rank owning their expert) and combine (results
    back); the backward of sending rows is receiving their gradients back.
    Placement: rows stay a shard of the tokens' rows; no partial sum may travel."""
    if group.size == 1:
        return x
    out = alltoallv_rows(group, x.data, send_counts, recv_counts)
    result = Tensor.from_op(out, (x,), lambda g: x.accumulate(
        alltoallv_rows(group, g, recv_counts, send_counts), fresh=True))
    return placement.follow(result, placement.rows_exchanged("alltoallv", x, group), x.name) \
        if placement.ON else result
