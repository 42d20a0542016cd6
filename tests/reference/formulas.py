"""A run's ledger and model-state bytes against the planner's formulas.

Every rank's parameter, gradient and optimizer bytes (memory.json of a `sweep` run)
and its ledger entries of the last step are what `costmodel.model_states` and
`timemodel.traffic` predict for minipar's own workload (`plan.minipar_workload`).
Alltoallv rows follow the router, so for them only the calls are checked per rank and
the elements summed over each ep group, when no capacity drops rows.
"""

from __future__ import annotations

import json

from minipar.planner.memory_cost import model_states, rank_shape
from minipar.planner.time_cost import ledger_of, traffic
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.settings.config import TrainConfig


def assert_ledger_and_memory_are_the_formulas(world: int, fields: dict, run: dict) -> None:
    """Fail naming the config, the rank and the entry that differs from the formula."""
    cfg = TrainConfig(**fields).resolved(world)
    w, plan, mesh = minipar_workload(cfg), plan_of(cfg), cfg.mesh_shape()
    memory = json.loads((run["job_folder"] / "memory.json").read_text())
    predicted = {}
    for rank in range(world):
        where = mesh.coords(rank)
        shape = rank_shape(w, plan, where["pp"])
        replica = where["dp"] * cfg.cp + where["cp"]  # ZeRO shards over the dp x cp ranks
        assert vars(model_states(w, plan, shape, replica)) == memory[rank], \
            f"{fields} rank {rank}"
        predicted[rank] = ledger_of(traffic(w, plan, shape))
        measured = {(r["group"], r["op"]): (r["calls"], r["elements"])
                    for r in run["ledger"] if r["rank"] == rank}
        assert measured.keys() == predicted[rank].keys(), f"{fields} rank {rank}"
        for key, (calls, elements) in measured.items():
            assert calls == predicted[rank][key][0], f"{fields} rank {rank} {key}"
            if key != ("ep", "Alltoallv"):
                assert elements == predicted[rank][key][1], f"{fields} rank {rank} {key}"
    balanced = cfg.ep > 1 and cfg.capacity_factor is None  # drops: fewer rows than b k
    for group in mesh.groups("ep") if balanced else []:
        measured = sum(r["elements"] for r in run["ledger"]
                       if r["rank"] in group and r["op"] == "Alltoallv")
        assert measured == sum(predicted[r][("ep", "Alltoallv")][1] for r in group), \
            f"{fields} ep group {group}"
