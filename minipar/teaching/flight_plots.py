"""The flight recorder's dumps as a picture: each rank's last calls, the stuck ones marked.

What this file teaches: a hang read at a glance. One row per rank, one box per
call (its last ten), coloured by the mesh axis it went to, labelled with the op
and its sequence number on that group; a red edge marks the call the rank is
still inside. Where the rows stop lining up -- a box one rank has and the others
lack, two ranks inside calls on different axes -- is where the ranks parted
(flight_report.py says it in words).

    figure = flight_figure({"hang-pp-both-recv": (load(folder), verdict(load(folder)))})
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

COLOURS = {"dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "ep": "tab:purple",
           "edp": "tab:olive", "cp": "tab:cyan", "world": "tab:gray"}
SHOWN = 10   # calls per rank


def flight_figure(runs: Mapping[str, tuple[dict[int, dict], str]],
                  title: str = "each rank's last calls when the job was stopped "
                               "(red edge: still inside it)") -> Figure:
    """One panel per run: `runs[name] = (dumps by rank, verdict)`."""
    figure = Figure(figsize=(11, 2.2 * len(runs) + 0.8))
    for row, (name, (dumps, said)) in enumerate(runs.items()):
        ax = figure.add_subplot(len(runs), 1, row + 1)
        ranks = sorted(dumps)
        for r in ranks:
            calls = dumps[r]["calls"][-SHOWN:]
            for i, call in enumerate(calls):
                x = i - len(calls) + SHOWN
                inside = call["state"] == "started"
                ax.barh(r, 0.9, left=x, color=COLOURS.get(call["axis"], "black"),
                        edgecolor="red" if inside else "white", linewidth=3 if inside else 0.5)
                ax.text(x + 0.45, r, f"{call['op'][:10]}\n{call['axis']} #{call['seq']}",
                        ha="center", va="center", fontsize=6, color="white")
        ax.set_xlim(-0.1, SHOWN)
        ax.set_ylim(max(ranks, default=0) + 0.6, -0.6)
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_xticks([])
        wrapped = said if len(said) < 150 else said[:147] + "..."
        ax.set_title(f"{name}: {wrapped}", fontsize=7, loc="left")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    return figure
