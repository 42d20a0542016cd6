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

import textwrap
from collections.abc import Mapping

from matplotlib.figure import Figure
from matplotlib.patches import Patch

COLOURS = {"dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "ep": "tab:purple",
           "edp": "tab:olive", "cp": "tab:cyan", "world": "tab:gray"}
SHOWN = 10   # calls per rank


def flight_figure(runs: Mapping[str, tuple[dict[int, dict], str]],
                  title: str = "each rank's last calls when the job was stopped "
                               "(red edge: still inside it)") -> Figure:
    """One panel per run: `runs[name] = (dumps by rank, verdict)`. Each panel's title is
    its run's whole verdict, wrapped (never cut); one legend says which colour is which
    mesh axis and what the red edge means."""
    titles = {name: textwrap.fill(f"{name}: {said}", 170) for name, (_, said) in runs.items()}
    heights = [1.9 + 0.13 * titles[name].count("\n") for name in runs]
    figure = Figure(figsize=(11, sum(heights) + 1.1), layout="constrained")
    axes = figure.subplots(len(runs), 1, squeeze=False, height_ratios=heights)[:, 0]
    axes_seen: set[str] = set()
    for ax, (name, (dumps, _)) in zip(axes, runs.items()):
        ranks = sorted(dumps)
        for r in ranks:
            calls = dumps[r]["calls"][-SHOWN:]
            for i, call in enumerate(calls):
                x = i - len(calls) + SHOWN
                inside = call["state"] == "started"
                axes_seen.add(call["axis"])
                ax.barh(r, 0.9, left=x, color=COLOURS.get(call["axis"], "black"),
                        edgecolor="red" if inside else "white", linewidth=3 if inside else 0.5)
                ax.text(x + 0.45, r, f"{call['op']}\n{call['axis']} #{call['seq']}",
                        ha="center", va="center", fontsize=6, color="white")
        ax.set_xlim(-0.1, SHOWN)
        ax.set_ylim(max(ranks, default=0) + 0.6, -0.6)
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_xticks([])
        ax.set_title(titles[name], fontsize=7, loc="left")
    handles = [Patch(color=COLOURS.get(axis, "black"), label=f"a call over {axis}")
               for axis in sorted(axes_seen)]
    handles.append(Patch(facecolor="white", edgecolor="red", linewidth=2,
                         label="the call the rank is still inside"))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=7)
    figure.suptitle(title, fontsize=9)
    return figure
