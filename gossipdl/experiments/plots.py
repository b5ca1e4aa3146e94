"""PNG plots of runs, drawn with matplotlib's file-only backend (no display needed).

Every PNG carries, in a ``gossipdl-axes`` text chunk, what each of its panels
shows (title, axis labels and scales, how many lines, the legend's labels,
and how many of each marked artist: ``band`` for a mean ± standard deviation
band, ``start-up`` for the span before training): tests and scripts check a
plot by reading the file, not by eye.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossipdl.rundir import counter, number

Curve = Sequence[Mapping[str, float]]
Records = Sequence[Mapping[str, Any]]
AXES_KEY = "gossipdl-axes"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only backend (never a window: headless machines,
    CI), imported on first use: 1.3 s of imports that a process which never plots does not
    pay (a benchmark's forked workers import its script, and so this module, again)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class Panel:
    """One subplot: which point keys go on which axis, and their labels."""

    x: str
    y: str
    xlabel: str
    ylabel: str
    log_x: bool = False


ACCURACY_VS_BYTES = Panel(
    "bytes_sent", "accuracy", "total bytes sent by all peers (log scale)", "mean test accuracy",
    log_x=True,
)  # fmt: skip
ACCURACY_VS_TIME = Panel(
    "training_s", "accuracy", "training time (s, start-up excluded)", "mean test accuracy"
)
ACCURACY_VS_STEPS = Panel("step", "accuracy", "local steps", "mean test accuracy")
DEVICES = Panel(
    "share", "own_accuracy", "devices, worst to best (share of the swarm)",
    "accuracy on the device's own test data",
)  # fmt: skip
BAND = "band"  # the gid of a shaded mean ± standard deviation band
STARTUP = "start-up"  # the gid of the shaded span before training began
MAX_LABELLED_PEERS = 16  # a timeline names each peer (tick, legend) up to this many


def save_figure(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG whose ``gossipdl-axes`` text chunk describes its panels."""
    axes = [
        {
            "title": ax.get_title(),
            "xlabel": ax.get_xlabel(),
            "ylabel": ax.get_ylabel(),
            "xscale": ax.get_xscale(),
            "yscale": ax.get_yscale(),
            "lines": len(ax.lines),
            "legend": [t.get_text() for t in legend.get_texts()]
            if (legend := ax.get_legend())
            else [],
            "marks": dict(Counter(gid for c in ax.get_children() if (gid := c.get_gid()))),
        }
        for ax in fig.axes
        if ax.get_label() != "<colorbar>"
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={AXES_KEY: json.dumps(axes)})
    pyplot().close(fig)
    return path


def plot_curves(
    curves: Mapping[str, Curve],
    path: Path,
    title: str,
    panels: Sequence[Panel] = (ACCURACY_VS_BYTES,),
    mark_x: float | None = None,
    mark_y: float | None = None,
) -> Path:
    """One line per variant in each panel, side by side; ``mark_x`` and ``mark_y`` draw dashed
    vertical and horizontal lines (an event, a target).

    ``curves`` maps a label to points as
    :func:`gossipdl.experiments.summary.accuracy_curve` returns them; points
    that carry ``<y>_std`` (:func:`~gossipdl.experiments.summary.mean_curve`)
    get a shaded band of ± one standard deviation around the line. On a log
    axis, points at x <= 0 (nothing sent yet) are left out.
    """
    fig, axes = pyplot().subplots(1, len(panels), figsize=(7 * len(panels), 4.5), dpi=120)
    for ax, panel in zip([axes] if len(panels) == 1 else axes, panels, strict=True):
        for n, (label, points) in enumerate(curves.items()):
            shown = [p for p in points if not panel.log_x or p[panel.x] > 0]
            x = [p[panel.x] for p in shown]
            y = [p[panel.y] for p in shown]
            style = ("-", "--", ":")[n // 10 % 3]  # the colour cycle has ten: tell the 11th apart
            (line,) = ax.plot(x, y, marker="o", markersize=3, linestyle=style, label=label)
            spread = f"{panel.y}_std"
            if shown and spread in shown[0]:
                std = [p[spread] for p in shown]
                ax.fill_between(
                    x,
                    [a - s for a, s in zip(y, std, strict=True)],
                    [a + s for a, s in zip(y, std, strict=True)],
                    color=line.get_color(),
                    alpha=0.2,
                    linewidth=0,
                    gid=BAND,
                )
        if panel.log_x:
            ax.set_xscale("log")
        if mark_x is not None:
            ax.axvline(mark_x, color="grey", linestyle="--", linewidth=1)
        if mark_y is not None:
            ax.axhline(mark_y, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def timed(lines: Records) -> list[Mapping[str, Any]]:
    """The lines that carry a ``time`` (a null one, or none: nowhere to draw them)."""
    return [r for r in lines if number(r, "time") is not None]


@dataclass(frozen=True)
class Interval:
    """A stretch of one peer's timeline: from ``start``, ``width`` seconds, ``away`` (offline
    or dead) or not, and the ``busy`` share of it (the rest: waiting for other peers)."""

    start: float
    width: float
    away: bool
    busy: float


def intervals(lines: Records) -> list[Interval]:
    """A peer's timeline from its metrics lines (``time``, ``online``, ``idle_s``; lines
    without a time are skipped). Between two lines it was busy for the share of the time it
    did not spend waiting for others (``idle_s``), or away when the later line says it was
    offline. Before a later life's first line (``start``) it was dead for that line's
    ``down_s`` (restarted, with or without its checkpoint; all of the gap when not
    recorded), and up for the rest of the gap since its last line."""
    found = []
    for a, b in itertools.pairwise(timed(lines)):
        begin, end = counter(a, "time"), counter(b, "time")
        width = end - begin
        if width <= 0:
            continue
        if not b.get("online", True):
            dead = width
        elif b.get("start"):
            down = number(b, "down_s")
            dead = width if down is None else min(width, max(0.0, down))
        else:
            dead = 0.0
        if dead < width:
            idle = (counter(b, "idle_s") - counter(a, "idle_s")) / (width - dead)
            found.append(Interval(begin, width - dead, False, 1 - min(1.0, max(0.0, idle))))
        if dead > 0:
            found.append(Interval(end - dead, dead, True, 0.0))
    return found


def plot_timeline(
    records: Mapping[int, Records], path: Path, title: str, startup_s: float = 0.0
) -> Path:
    """Per-peer timelines over wall time: online or offline, busy or idle, bytes sent.

    ``records`` maps a peer id to its metrics lines (``time``, ``online``,
    ``idle_s``, ``bytes_sent``), drawn as their :func:`intervals`: busy share,
    or away (offline, or dead before a restarted life's first line). The first
    ``startup_s`` seconds (forming the swarm) are shaded in every panel.
    """
    plt = pyplot()
    fig, (up, busy, sent) = plt.subplots(3, 1, figsize=(10, 8), dpi=120, sharex=True)
    # a fixed layout (the panels' labels are fixed): matplotlib's constrained layout took
    # a third of drawing it
    fig.subplots_adjust(left=0.09, right=0.86, bottom=0.07, top=0.91, hspace=0.3)
    colormap = plt.get_cmap("viridis")
    for peer_id, lines in sorted(records.items()):
        parts = intervals(lines)
        bars = [(part.start, part.width) for part in parts]
        up_colours = ["tab:red" if part.away else "tab:green" for part in parts]
        up.broken_barh(bars, (peer_id - 0.4, 0.8), facecolors=up_colours)
        colours = ["lightgrey" if part.away else colormap(part.busy) for part in parts]
        busy.broken_barh(bars, (peer_id - 0.4, 0.8), facecolors=colours)
        points = timed(lines)
        sent.plot(
            [counter(r, "time") for r in points], [counter(r, "bytes_sent") / 1e6 for r in points],
            label=f"peer {peer_id}",
        )  # fmt: skip
    up.set_title("online (green) / offline (red)")
    busy.set_title("busy share of each interval (the rest: waiting for other peers; grey: away)")
    for ax in (up, busy):
        ax.set_ylabel("peer")
        if len(records) <= MAX_LABELLED_PEERS:
            ax.set_yticks(sorted(records))
        else:  # hundreds of simulated peers: a few integer ticks, not one label each
            ax.yaxis.set_major_locator(plt.MaxNLocator(nbins=10, integer=True))
    if startup_s > 0:
        for ax in (up, busy, sent):
            label = f"start-up ({startup_s:.1f} s)"
            ax.axvspan(0, startup_s, color="tab:orange", alpha=0.15, gid=STARTUP, label=label)
    scale = fig.add_axes((0.88, 0.07, 0.02, 0.84), label="<colorbar>")  # not a panel
    fig.colorbar(plt.cm.ScalarMappable(cmap=colormap), cax=scale, label="busy share")
    sent.set_title("bytes sent")
    sent.set_xlabel("time since the swarm started (s; simulated seconds for gossipdl simulate)")
    sent.set_ylabel("bytes sent (MB)")
    sent.grid(True, alpha=0.3)
    if len(records) <= MAX_LABELLED_PEERS:  # beyond, a legend would hide the lines
        sent.legend(fontsize=7, ncol=4)
    elif startup_s > 0:
        sent.legend(handles=[h for h in sent.patches if h.get_gid() == STARTUP], fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path)
