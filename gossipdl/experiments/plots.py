"""PNG plots of runs, drawn with matplotlib's file-only backend (no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # write files; never open a window (headless machines, CI)

import matplotlib.pyplot as plt

Curve = Sequence[Mapping[str, float]]


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


def plot_curves(
    curves: Mapping[str, Curve],
    path: Path,
    title: str,
    panels: Sequence[Panel] = (ACCURACY_VS_BYTES,),
    mark_x: float | None = None,
) -> Path:
    """One line per variant in each panel, side by side; ``mark_x`` draws a dashed vertical line.

    ``curves`` maps a label to points as
    :func:`gossipdl.experiments.summary.accuracy_curve` returns them. On a
    log axis, points at x <= 0 (nothing sent yet) are left out.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), dpi=120)
    for ax, panel in zip([axes] if len(panels) == 1 else axes, panels, strict=True):
        for label, points in curves.items():
            shown = [p for p in points if not panel.log_x or p[panel.x] > 0]
            ax.plot(
                [p[panel.x] for p in shown],
                [p[panel.y] for p in shown],
                marker="o",
                markersize=3,
                label=label,
            )
        if panel.log_x:
            ax.set_xscale("log")
        if mark_x is not None:
            ax.axvline(mark_x, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
