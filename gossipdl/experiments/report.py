"""``gossipdl report DIR [DIR ...]``: PNG plots and markdown tables that compare runs.

Each DIR is a run directory or a sweep's (``sweep.json``: its variants are
the runs). Directories whose peers carry the same ``swarm`` id are one run
(``gossipdl peer``/``join`` on each machine of a swarm write their own
directory) and are merged: its peers come from all of them. Runs whose
``config.toml`` differ only in ``seed`` (and in keys that do not change
results: output paths and addresses) form a group, shown as the mean ± the
sample standard deviation over its runs; legends and the group table name a
group by the config keys that vary between the groups.

Writes, into ``DIR/report/`` for one directory and into
``<common parent>/report-<names>/`` for several (unless ``out`` is given):
``accuracy.png`` (mean test accuracy against local steps, training time and
bytes sent, a line per group with a shaded band for groups of several runs),
``timeline.png`` per run (``timeline-<run>.png`` when there are several, or
a sweep; the start-up span shaded), ``devices.png`` where peers hold their own
owners' data (natural splits: each device's accuracy on its own test data,
worst to best, a line per run) and ``report.md``, the tables with the plots
linked.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gossipdl.config import Config, ConfigError, read_config_file, to_dict
from gossipdl.experiments.display import human_bytes
from gossipdl.experiments.plots import (
    ACCURACY_VS_BYTES,
    ACCURACY_VS_STEPS,
    ACCURACY_VS_TIME,
    DEVICES,
    plot_curves,
    plot_timeline,
)
from gossipdl.experiments.summary import (
    SUSPECT_DISTANCE,
    SUSPECT_SHARE,
    Run,
    accuracy_curve,
    device_curve,
    judged_neighbours,
    mean_curve,
    peer_lines,
    startup_time,
    summary_of,
)
from gossipdl.experiments.sweep import REPORT_DIR, SWEEP_FILE
from gossipdl.rundir import RunDir, RunDirError, number, read_json

# config keys that say where output goes or how peers reach each other, not what is computed
NOT_RESULTS = frozenset({"out", "host", "advertise", "tensorboard", "csv", "metrics_hook"})
_LONGEST_NAME = 60  # characters of directory names in a default ``report-<names>`` folder
STAT_HEADERS = (
    "finished",
    "mean acc",
    "min acc",
    "start-up s",
    "training s",
    "bytes sent",
    "dropped",
)


class ReportError(ValueError):
    """A directory that holds no run to report on; the message says what is missing."""


def run_dirs(root: Path) -> list[RunDir]:
    """The run directories in ``root`` that hold peer metrics: a sweep's variants
    (``sweep.json``), else ``root`` itself."""
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory; pass a run or sweep directory")
    sweep = root / SWEEP_FILE
    if sweep.is_file():
        try:
            names = [str(v["name"]) for v in read_json(sweep)["variants"]]
        except (KeyError, TypeError):
            raise ReportError(
                f'{sweep} lists no variants ({{"variants": [{{"name": ...}}]}}); re-run the sweep'
            ) from None
        runs = [RunDir(root / name) for name in names]
    else:
        runs = [RunDir(root)]
    runs = [run for run in runs if run.peer_ids()]
    if not runs:
        raise ReportError(
            f"{root} holds no peer metrics (peers/<id>.jsonl); is it a gossipdl run directory?"
        )
    return runs


def swarm_of(run: RunDir) -> str | None:
    """The ``swarm`` id on the first lines of ``run``'s peers, with the swarm's start (None
    for runs from before swarm ids: such a directory is a run of its own). A simulated
    swarm's id is its config's, so two runs of one config differ by their start alone."""
    ids = set()
    for peer_id in run.peer_ids():
        first = next(run.records(peer_id), None)
        if first is not None and first.get("swarm"):
            start = first.get("swarm_start")
            ids.add(str(first["swarm"]) + ("" if start is None else f" started {start}"))
    if len(ids) > 1:
        raise ReportError(
            f"{run.root} holds peers of {len(ids)} swarms ({', '.join(sorted(ids))}); a run "
            "directory holds one run: move the other swarm's peers/<id>.jsonl into a directory "
            "of their own"
        )
    return next(iter(ids), None)


def runs_of(directories: Sequence[Path]) -> list[Run]:
    """The runs in ``directories`` (a sweep's variants each); directories whose peers carry
    the same swarm id and start are merged into one run (a swarm's peers on several
    machines, each with its own run directory)."""
    by_swarm: dict[str, list[RunDir]] = {}
    seen: set[Path] = set()
    for directory in directories:
        for run in run_dirs(directory):
            root = run.root.resolve()
            if root not in seen:
                seen.add(root)
                by_swarm.setdefault(swarm_of(run) or str(root), []).append(run)
    return [Run(*dirs) for dirs in by_swarm.values()]


def run_names(runs: Sequence[Run]) -> list[str]:
    """Each run's name: its directories' paths below the deepest folder holding all of them,
    joined by ``+`` when it was merged from several."""
    roots = [d.root.resolve() for run in runs for d in run.dirs]
    base = Path(os.path.commonpath(roots))
    if base in roots:
        base = base.parent
    return ["+".join(str(d.root.resolve().relative_to(base)) for d in run.dirs) for run in runs]


def _config(run: Run) -> dict[str, Any] | None:
    """The run's config.toml over the defaults (a run from an older gossipdl lacks newer keys,
    one from a newer gossipdl has keys this one does not know: kept, as the contract adds
    keys); None when none of its directories has one."""
    path = next((d.config for d in run.dirs if d.config.is_file()), None)
    if path is None:
        return None
    try:
        return {**to_dict(Config()), **read_config_file(path, known_keys=False)}
    except ConfigError as exc:
        raise ReportError(f"{exc}; restore it, or delete it to report the run alone") from None


TOML_TIMES = (datetime.date, datetime.time)  # a TOML date, time or datetime, as tomllib reads it


def _toml_time(value: Any) -> str:
    """``json.dumps``'s fallback: a TOML date, time or datetime (a config.toml from a newer
    gossipdl may hold one; JSON has none) as its ISO text."""
    if isinstance(value, TOML_TIMES):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} {value!r} is not a TOML value")


def _json(value: Any) -> str:
    """A config value as JSON with sorted keys, TOML times as their text: what tells two
    configs' values apart."""
    return json.dumps(value, sort_keys=True, default=_toml_time)


def _value(value: Any) -> str:
    """A config value as a legend names it: text and TOML times as written, the rest JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, TOML_TIMES):
        return value.isoformat()
    return json.dumps(value, default=_toml_time)


def group_runs(configs: Sequence[dict[str, Any] | None]) -> list[tuple[list[int], dict[str, str]]]:
    """Indices of the runs whose configs differ only in ``seed`` and NOT_RESULTS keys, each
    group with the values of the keys that vary between the groups (a run without a config
    is a group of its own, named by nothing)."""
    members: dict[str, list[int]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for i, config in enumerate(configs):
        if config is None:
            members[f"#{i}"] = [i]
            continue
        kept = {k: v for k, v in config.items() if k not in NOT_RESULTS and k != "seed"}
        key = _json(kept)
        members.setdefault(key, []).append(i)
        settings[key] = kept
    keys = dict.fromkeys(k for kept in settings.values() for k in kept)
    varying = [k for k in keys if len({_json(s.get(k)) for s in settings.values()}) > 1]
    return [
        (indices, {k: _value(settings[key].get(k)) for k in varying} if key in settings else {})
        for key, indices in members.items()
    ]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _spread(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    """One cell: the value, or for several runs mean ± sample standard deviation; "-" if none."""
    known = [v for v in values if v is not None]
    if len(known) < 2:
        return fmt(known[0]) if known else "-"
    return f"{fmt(statistics.fmean(known))} ± {fmt(statistics.stdev(known))}"


def stat_cells(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """The STAT_HEADERS cells of one run, or of a group of runs aggregated."""

    def spread(key: str, fmt: Callable[[float], str]) -> str:
        return _spread([s[key] for s in summaries], fmt)

    finished = sum(s["peers_finished"] for s in summaries)
    return [
        f"{finished}/{sum(len(s['peers']) for s in summaries)}",
        spread("mean_accuracy", lambda v: f"{v:.4f}"),
        spread("min_accuracy", lambda v: f"{v:.4f}"),
        spread("startup_s", lambda v: f"{v:.1f}"),
        spread("training_s", lambda v: f"{v:.1f}"),
        spread("total_bytes_sent", human_bytes),
        spread("total_messages_dropped", lambda v: f"{v:.0f}"),
    ]


def measured_wall_time(run: Run) -> float | None:
    """The wall time the run's launch measured (the latest ``wall_time_s`` of its directories'
    summary.json: the peers' last lines miss the time it took to stop them); None unless
    every directory has a readable one (a live run, a machine still training)."""
    times: list[float | None] = []
    for directory in run.dirs:
        summary = None
        with contextlib.suppress(RunDirError):  # none yet, or torn: the lines' time then
            summary = read_json(directory.summary)
        times.append(number(summary, "wall_time_s") if isinstance(summary, dict) else None)
    known = [t for t in times if t is not None]
    return max(known) if known and len(known) == len(times) else None


def file_names(names: Sequence[str]) -> list[str]:
    """The runs' names as parts of file names, unique: ``-2``, ``-3``... added to one that
    another already made (``exp/seed0`` and ``exp_seed0`` are both ``exp_seed0``)."""
    taken: list[str] = []
    for name in names:
        safe = base = re.sub(r"[^A-Za-z0-9._+-]", "_", name)
        copy = 1
        while safe in taken:
            copy += 1
            safe = f"{base}-{copy}"
        taken.append(safe)
    return taken


def _default_out(directories: Sequence[Path]) -> Path:
    """``DIR/report`` for one directory; for several, ``report-<their names>`` in the deepest
    folder holding them all."""
    if len(directories) == 1:
        return directories[0] / REPORT_DIR
    roots = [d.resolve() for d in directories]
    names = "+".join(root.name for root in roots)
    if len(names) > _LONGEST_NAME:
        names = f"{roots[0].name}+{len(roots) - 1}-more"
    return Path(os.path.commonpath(roots)) / f"report-{names}"


def _judged(rows: Sequence[dict[str, Any]]) -> str:
    """The per-neighbour table: the suspects first, marked."""
    table = markdown_table(
        ["neighbour", "judged by", "rounds", "mean distance", "set aside", ""],
        [
            [r["id"], r["judged"], r["rounds"], f"{r['distance']:.4g}",
             f"{r['filtered']:.1%}", "**looks wrong**" if r["suspect"] else ""]
            for r in rows
        ],
    )  # fmt: skip
    return (
        "Each peer with a defence records, per neighbour, its distance to the peer's model "
        "and the share of rounds the defence set it aside; summed over the peers that "
        f"judged it. A neighbour looks wrong when set aside in at least {SUSPECT_SHARE:.0%} "
        f"of its rounds and twice as often as the median, or at {SUSPECT_DISTANCE:g}x the "
        "median distance.\n\n" + table
    )


def _devices(devices: dict[str, list[dict[str, float]]]) -> str:
    """The natural splits' table: how the shared model serves each run's devices."""

    def at(curve: list[dict[str, float]], share: float) -> float:
        return curve[min(len(curve) - 1, int(share * len(curve)))]["own_accuracy"]

    rows = [
        [name, len(curve), f"{statistics.fmean(p['own_accuracy'] for p in curve):.4f}",
         f"{curve[0]['own_accuracy']:.4f}", f"{at(curve, 0.1):.4f}", f"{at(curve, 0.5):.4f}",
         f"{curve[-1]['own_accuracy']:.4f}"]
        for name, curve in devices.items()
    ]  # fmt: skip
    return (
        "Each device's accuracy on its own test data (its writers', speakers' or users'): "
        "the spread is what a shared model costs the devices it serves worst.\n\n"
        + markdown_table(["run", "devices", "mean", "worst", "10th pct", "median", "best"], rows)
        + "\n\n![devices](devices.png)\n"
    )


def write_report(directories: Sequence[Path], out: Path | None = None) -> list[Path]:
    """Draw the plots and write ``report.md`` comparing the runs in ``directories`` (run or
    sweep directories) into ``out``; returns the files written."""
    directories = list({Path(d).resolve(): Path(d) for d in directories}.values())
    if not directories:
        raise ReportError("no directory to report on; pass one or more run or sweep directories")
    runs = runs_of(directories)
    names = run_names(runs)
    out = out or _default_out(directories)
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out} is a file; name a directory for the report (--out)")
    sweep = len(directories) == 1 and (directories[0] / SWEEP_FILE).is_file()
    several = sweep or len(runs) > 1
    configs = [_config(run) for run in runs]
    groups = group_runs(configs)
    labels = [
        ", ".join(f"{k}={v}" for k, v in varying.items())
        or (names[indices[0]] if len(indices) == 1 else f"mean of {len(indices)} runs")
        for indices, varying in groups
    ]
    if sweep:
        title = f"sweep {directories[0].resolve().name}"
    else:
        title = f"run {names[0]}" if len(runs) == 1 else f"{len(runs)} runs"
    if any(len(indices) > 1 for indices, _ in groups):
        title += " (mean ± std over seeds)"
    files = [
        plot_curves(
            {
                label: mean_curve([accuracy_curve(runs[i]) for i in indices])
                for label, (indices, _) in zip(labels, groups, strict=True)
            },
            out / "accuracy.png",
            title,
            panels=(ACCURACY_VS_STEPS, ACCURACY_VS_TIME, ACCURACY_VS_BYTES),
        )
    ]
    summaries = [summary_of(run, measured_wall_time(run)) for run in runs]
    run_rows = []
    for run, name, safe, config, summary in zip(
        runs, names, file_names(names), configs, summaries, strict=True
    ):
        timeline = out / (f"timeline-{safe}.png" if several else "timeline.png")
        lines = peer_lines(run)
        files.append(
            plot_timeline(lines, timeline, f"{name}: peers over time", startup_time(lines))
        )
        run_rows.append(
            [
                name,
                (config or {}).get("seed", "-"),
                *stat_cells([summary]),
                f"![timeline]({timeline.name})",
            ]
        )
    sections = [f"# {title}\n"]
    if len(runs) > 1:
        group_rows = [
            [label, len(indices), *stat_cells([summaries[i] for i in indices])]
            for label, (indices, _) in zip(labels, groups, strict=True)
        ]
        sections.append(
            "Runs that differ only by seed are one group: mean ± sample standard deviation "
            "over its runs.\n\n" + markdown_table(["group", "runs", *STAT_HEADERS], group_rows)
        )
    sections.append("![accuracy](accuracy.png)\n")
    sections.append("## Runs\n\n" + markdown_table(["run", "seed", *STAT_HEADERS, ""], run_rows))
    devices = {
        name: curve for name, s in zip(names, summaries, strict=True) if (curve := device_curve(s))
    }
    if devices:
        files.append(plot_curves(devices, out / "devices.png", f"{title}: each device", (DEVICES,)))
        sections.append("## Devices\n\n" + _devices(devices))
    for run, name in zip(runs, names, strict=True):
        judged = judged_neighbours(peer_lines(run))
        if judged:
            sections.append(f"## Neighbours as {name}'s defences saw them\n\n" + _judged(judged))
    report = out / "report.md"
    report.write_text("\n".join(sections))
    return [*files, report]
