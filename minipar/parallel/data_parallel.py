"""Data parallelism: every rank holds the whole model and a slice of the batch.

What this file teaches (the source text's first strategy): with the global
batch cut into dp equal slices, each rank's gradient g_i is the gradient of its
slice's mean loss, and the full-batch gradient is their average,

    g = 1/dp * sum_i g_i          (batch 1024 on 8 ranks: 128 each, 1/8 sum)

computed with one Allreduce(SUM) and a division. Run it:
`mpiexec -n 8 python -m mpi4py lessons/01_data_parallel.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpi4py import MPI

from minipar.nn import Parameter


def allreduce_gradients(params: Sequence[Parameter], mesh: object) -> None:
    """Naive DP: one Allreduce per parameter, then divide by dp.

    A parameter replicated over all data-parallel ranks (`sync="dp"`) sums over
    the dp group. An expert weight (`sync="edp"`) lives on one rank of each
    expert-parallel group and sums over the ranks holding the same experts; it
    is still divided by dp, because each of its contributions was the gradient of
    one rank's *local mean* loss, of which there are dp in the global mean.
    """
    for p in params:
        if p.grad is None or p.sync is None:
            continue
        group = mesh.dp if p.sync == "dp" else mesh.edp
        if group.size > 1:
            group.Allreduce(MPI.IN_PLACE, p.grad, op=MPI.SUM)  # g_i of every replica -> sum
        if mesh.shape.dp > 1:
            p.grad /= mesh.shape.dp
