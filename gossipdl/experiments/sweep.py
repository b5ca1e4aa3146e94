"""``gossipdl sweep``: one experiment file run over a grid of settings, into one directory.

``--grid codec=none,topk:0.01 --grid topology=ring,exponential`` makes the
four combinations (a value with commas of its own is bracketed or quoted:
``hidden=[64,32],[128]``, ``link="up=10mbit,down=10mbit","up=1mbit"``). Every
variant's config is built and validated before the first one starts, each
runs into ``DIR/<variant>/`` (a normal run directory; ``--csv`` and
``--tensorboard`` into ``<their DIR>/<variant>/``), and ``DIR/sweep.json``
lists them with their settings and results; a variant that fails is
recorded as failed, with its error, and the others still run. A ``DIR``
that already holds a run or a sweep is refused before anything starts.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gossipdl.config import FIELDS, SINK_DIRS, TABLE_KEYS, Config, ConfigError
from gossipdl.peers.sinks import refuse_used_sink_dirs
from gossipdl.rundir import RunDir, RunDirError, read_json, write_json_atomic

Grid = dict[str, list[Any]]  # values as typed on the command line, or parsed
SWEEP_FILE = "sweep.json"
REPORT_DIR = "report"
# one --grid value: up to a comma outside brackets, braces and quotes (not nested ones)
_VALUE = re.compile(r"""(?:\[[^\]]*\]|\{[^}]*\}|"[^"]*"|'[^']*'|[^,])+""")


def parse_grid(items: Sequence[str]) -> Grid:
    """``["codec=none,topk:0.01", "peers=4,8"]`` as ``{"codec": [...], "peers": [...]}``; a
    comma inside brackets, braces or quotes belongs to its value (parse_value unquotes it).

    Example:
        >>> parse_grid(["codec=none,topk:0.01", 'hidden=[64,32],"8,8"'])
        {'codec': ['none', 'topk:0.01'], 'hidden': ['[64,32]', '"8,8"']}
    """
    grid: Grid = {}
    for item in items:
        key, _, values = item.partition("=")
        key = key.strip().replace("-", "_")
        choices = [v.strip() for v in _VALUE.findall(values) if v.strip()]
        if not choices:
            raise ConfigError(f"--grid {item!r}: use KEY=VALUE1,VALUE2, e.g. codec=none,topk:0.01")
        if key not in FIELDS or key in ("out", *TABLE_KEYS):
            raise ConfigError(
                f"--grid {item!r}: {key!r} is not a config key a sweep can vary; "
                f"known keys: {sorted(set(FIELDS) - {'out', *TABLE_KEYS})}"
            )
        if key in grid:
            raise ConfigError(f"--grid {key} is given twice; list all its values in one --grid")
        grid[key] = choices
    if not grid:
        raise ConfigError("a sweep needs at least one --grid KEY=VALUE1,VALUE2")
    return grid


def variant_name(settings: dict[str, Any]) -> str:
    """A directory name for one combination: ``codec-topk_0.01__topology-ring``."""
    parts = [f"{key}-{value}" for key, value in settings.items()]
    return "__".join(re.sub(r"[^A-Za-z0-9._-]", "_", part) for part in parts)


def occupied(directory: Path) -> list[str]:
    """What in ``directory`` shows a run or a sweep already wrote there (empty if nothing)."""
    run = RunDir(directory)
    marks = [
        directory / SWEEP_FILE,
        directory / REPORT_DIR,
        run.config,
        run.summary,
        run.root / "peers",
    ]
    return [mark.name for mark in marks if mark.exists()]


def plan(base: Config, grid: Grid, out: Path) -> list[tuple[str, dict[str, Any], Config]]:
    """Every combination as (name, settings, validated config writing to ``out/name``, and its
    SINK_DIRS to ``<theirs>/name``: one peer id's files per variant); an ``out`` or variant
    directory that already holds a run or a sweep, or a sink's that holds files, is a
    ConfigError."""
    variants: list[tuple[str, dict[str, Any], Config]] = []
    for values in itertools.product(*grid.values()):
        settings = dict(zip(grid, values, strict=True))
        name = variant_name(settings)
        changes = {**settings, "out": str(out / name)}
        for key in SINK_DIRS:
            if sink := changes.get(key, getattr(base, key)):
                changes[key] = str(Path(sink) / name)
        try:
            config = base.replace(**changes)
        except ConfigError as exc:
            raise ConfigError(f"variant {name}: {exc}") from None
        if any(name == other for other, _, _ in variants):
            raise ConfigError(
                f"variant {name} comes twice: its values {settings} name one run directory; "
                "list each --grid value once"
            )
        variants.append((name, settings, config))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; name a directory for the sweep")
    for directory in [out, *(Path(config.out) for _, _, config in variants)]:
        found = occupied(directory)
        if found:
            raise ConfigError(
                f"{directory} already holds a run or a sweep ({', '.join(found)}); its results "
                "would be mixed with or replaced by the new ones: choose another --out or delete it"
            )
    for _, _, config in variants:
        refuse_used_sink_dirs(config)
    return variants


def run_sweep(
    base: Config,
    grid: Grid,
    out: Path,
    launch: Callable[[Config], dict[str, Any]],
    on_failure: Callable[[str, Exception], None] = lambda name, exc: None,
) -> list[dict[str, Any]]:
    """Run every variant with ``launch`` (which returns the run's summary) and write
    ``out/sweep.json``; returns its variant entries. Ctrl-C or SIGTERM stops the sweep in
    the variant it was running, which is listed as ``interrupted`` with what it measured."""
    variants = plan(base, grid, out)
    out.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    for name, settings, config in variants:
        entry: dict[str, Any] = {"name": name, "settings": settings, "run_dir": config.out}
        entries.append(entry)
        try:
            entry.update(_results(launch(config)))
        except KeyboardInterrupt:  # the launch wrote what it measured: list it, then stop
            entry["interrupted"] = True
            with contextlib.suppress(RunDirError):
                entry.update(_results(read_json(RunDir(config.out).summary)))
            write_json_atomic(out / SWEEP_FILE, {"grid": grid, "variants": entries})
            raise
        except Exception as exc:  # one broken variant must not lose the others
            on_failure(name, exc)
            entry["error"] = str(exc)
        write_json_atomic(out / SWEEP_FILE, {"grid": grid, "variants": entries})
    return entries


def _results(summary: dict[str, Any]) -> dict[str, Any]:
    """What ``sweep.json`` lists of a variant's summary."""
    keys = ("mean_accuracy", "min_accuracy", "total_bytes_sent", "wall_time_s", "startup_s",
            "training_s", "peers_finished")  # fmt: skip
    return {key: summary[key] for key in keys}
