"""``gossipdl report DIR``: PNG plots and a markdown table for a run or a sweep directory.

Writes into ``DIR/report/``: ``accuracy.png`` (mean test accuracy against
local steps, wall time and bytes sent, one line per variant), ``timeline.png``
(per peer: online or offline, busy or waiting, bytes sent; one file per
variant for a sweep, ``timeline-<variant>.png``) and ``report.md``, a table of
the results with the plots linked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gossipdl.experiments.display import human_bytes
from gossipdl.experiments.plots import (
    ACCURACY_VS_BYTES,
    ACCURACY_VS_STEPS,
    ACCURACY_VS_TIME,
    plot_curves,
    plot_timeline,
)
from gossipdl.experiments.summary import accuracy_curve, summarize
from gossipdl.experiments.sweep import SWEEP_FILE
from gossipdl.rundir import RunDir

REPORT_DIR = "report"


class ReportError(ValueError):
    """A directory that holds no run to report on; the message says what is missing."""


def runs_of(root: Path) -> dict[str, RunDir]:
    """The runs under ``root``: a sweep's variants (``sweep.json``), else ``root`` itself."""
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory; pass a run or sweep directory")
    sweep = root / SWEEP_FILE
    if sweep.is_file():
        try:
            names = [str(v["name"]) for v in _read_json(sweep)["variants"]]
        except (KeyError, TypeError):
            raise ReportError(
                f'{sweep} lists no variants ({{"variants": [{{"name": ...}}]}}); re-run the sweep'
            ) from None
        runs = {name: RunDir(root / name) for name in names}
    else:
        runs = {root.resolve().name: RunDir(root)}
    runs = {name: run for name, run in runs.items() if run.peer_ids()}
    if not runs:
        raise ReportError(
            f"{root} holds no peer metrics (peers/<id>.jsonl); is it a gossipdl run directory?"
        )
    return runs


def _read_json(path: Path) -> Any:
    """A JSON file the report needs; a torn or hand-edited one is a ReportError naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path} is not readable JSON ({exc}); re-run, or restore it") from None


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def write_report(root: str | Path) -> list[Path]:
    """Draw the plots and write ``report.md`` for the run or sweep at ``root``; returns the
    files written."""
    root = Path(root)
    runs = runs_of(root)
    out = root / REPORT_DIR
    sweep = len(runs) > 1 or (root / SWEEP_FILE).is_file()
    title = f"{'sweep' if sweep else 'run'} {root.resolve().name}"
    files = [
        plot_curves(
            {name: accuracy_curve(run) for name, run in runs.items()},
            out / "accuracy.png",
            title,
            panels=(ACCURACY_VS_STEPS, ACCURACY_VS_TIME, ACCURACY_VS_BYTES),
        )
    ]
    rows = []
    for name, run in runs.items():
        timeline = out / (f"timeline-{name}.png" if sweep else "timeline.png")
        records = {peer_id: list(run.records(peer_id)) for peer_id in run.peer_ids()}
        files.append(plot_timeline(records, timeline, f"{name}: peers over time"))
        summary = _read_json(run.summary) if run.summary.is_file() else summarize(run)
        rows.append(
            [
                name,
                f"{summary['peers_finished']}/{len(summary['peers'])}",
                _accuracy(summary["mean_accuracy"]),
                _accuracy(summary["min_accuracy"]),
                f"{summary['wall_time_s']:.1f}",
                human_bytes(summary["total_bytes_sent"]),
                summary["total_messages_dropped"],
                f"![timeline]({timeline.name})",
            ]
        )
    table = markdown_table(
        ["variant", "finished", "mean acc", "min acc", "wall s", "bytes sent", "dropped", ""],
        rows,
    )
    report = out / "report.md"
    report.write_text(f"# {title}\n\n{table}\n![accuracy](accuracy.png)\n")
    return [*files, report]
