"""Where a peer's metrics lines go besides ``peers/<id>.jsonl``: TensorBoard, CSV, a user hook.

Each sink gets every line the runner writes, a copy of its own. gossipdl
depends on neither TensorBoard nor anything else here: ``tensorboard`` is
imported only when asked for, and a missing package is a clear error before
training starts. A hook is the user's own code, named in their own config
(a swarm's config from another peer can never set it: ``gossipdl.trust``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gossipdl.config import SINK_DIRS, Config, ConfigError
from gossipdl.plugins import call_plugin, load_callable
from gossipdl.rundir import RunDir, atomic_file, cut_to_last_line, json_safe

log = logging.getLogger(__name__)

Sink = Callable[[dict[str, Any]], None]


def _scalars(line: dict[str, Any]) -> dict[str, float]:
    """The line's numbers (bools and nested values left out), for TensorBoard."""
    return {
        k: float(v)
        for k, v in line.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("peer", "step")
    }


class _TensorBoard:
    """One event file per peer under ``DIR/peer-<id>``: every number against the step."""

    def __init__(self, root: str, peer_id: int) -> None:
        self._writer = _summary_writer(root)(log_dir=str(Path(root) / f"peer-{peer_id}"))

    def __call__(self, line: dict[str, Any]) -> None:
        for key, value in _scalars(line).items():
            self._writer.add_scalar(key, value, line["step"], walltime=line.get("unix_time"))

    def close(self) -> None:
        self._writer.close()


class _Csv:
    """``DIR/<id>.csv``: one row per line, nested values as JSON text. The columns are the
    keys seen so far (an earlier life's header first): a row is appended, and a line with a
    new key rewrites the file once with the wider header, atomically, so a peer killed then
    (churn) leaves the old file whole (the rows are read back, not kept in memory)."""

    def __init__(self, root: str, peer_id: int) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.path = Path(root) / f"{peer_id}.csv"
        self._columns: list[str] = []
        if self.path.is_file():  # a resumed peer's earlier life: its rows go on
            cut_to_last_line(self.path)  # a row a killed life left half written
            with self.path.open(newline="") as f:
                self._columns = next(csv.reader(f), [])
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None

    def __call__(self, line: dict[str, Any]) -> None:
        row = {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in line.items()}
        if any(k not in self._columns for k in row):
            self._widen(row)
            return
        if self._writer is None:
            self._file = self.path.open("a", newline="", buffering=1)
            self._writer = csv.DictWriter(self._file, self._columns, restval="")
        self._writer.writerow(row)

    def _widen(self, row: dict[str, Any]) -> None:
        """Replace the file by one with ``row``'s new keys added to the header, its rows, and
        ``row``; the next rows append to it."""
        self.close()
        self._file = self._writer = None
        columns = self._columns + [k for k in row if k not in self._columns]
        with atomic_file(self.path, newline="") as out:
            writer = csv.DictWriter(out, columns, restval="", extrasaction="ignore")
            writer.writeheader()
            if self.path.is_file():
                with self.path.open(newline="") as f:
                    writer.writerows(csv.DictReader(f))
            writer.writerow(row)
        self._columns = columns

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _summary_writer(root: str) -> Any:
    """TensorBoard's ``SummaryWriter`` class, or a ConfigError saying how to get it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            f"tensorboard = {root!r} needs the tensorboard package: pip install "
            "tensorboard, or leave --tensorboard out"
        ) from None
    return SummaryWriter


def _hook_factory(spec: str) -> Callable[..., Any]:
    """The user's ``module:function``, imported (not called): ConfigError naming it if it
    cannot be (:func:`~gossipdl.plugins.load_callable`)."""
    return load_callable(spec, "metrics_hook =", ConfigError)


def check_sinks(config: Config) -> None:
    """Fail now, before the peer joins anyone (and a launch makes its run directory), if a
    sink the config asks for cannot work: a folder that cannot be made, tensorboard not
    installed, a hook that does not import."""
    for key in SINK_DIRS:
        if folder := getattr(config, key):
            _check_folder(key, folder)
    if config.tensorboard:
        _summary_writer(config.tensorboard)
    if config.metrics_hook:
        _hook_factory(config.metrics_hook)


def _check_folder(key: str, folder: str) -> None:
    """ConfigError unless ``folder`` is a folder this process can write in, or can be made
    one: otherwise every peer fails only once the swarm has formed."""
    path = Path(os.path.abspath(folder))
    there = next(p for p in (path, *path.parents) if p.exists())
    if not there.is_dir():
        why = f"{there} is a file"
    elif not os.access(there, os.W_OK | os.X_OK):
        why = f"no permission to write in {there}"
    else:
        return
    raise ConfigError(f"{key} = {folder!r}: {why}; name a folder that can be made")


def refuse_used_sink_dirs(config: Config) -> None:
    """ConfigError if a sink's folder already holds files: a new run's peers would add their
    rows to an earlier run's (only ``gossipdl peer --resume`` carries a peer on in its own)."""
    for key in SINK_DIRS:
        folder = Path(getattr(config, key))
        if getattr(config, key) and folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(
                f"{key} = {str(folder)!r} already holds files: the new run's peers would add "
                f"to them; choose another --{key} or delete it"
            )


def refuse_used_sink_files(config: Config, peer_id: int) -> None:
    """ConfigError if a sink already holds peer ``peer_id``'s files of another run: a peer
    started by hand shares its folders with its swarm (:func:`refuse_used_sink_dirs` cannot
    be asked of it), and its rows would go on after that run's."""
    files = {"csv": f"{peer_id}.csv", "tensorboard": f"peer-{peer_id}"}
    for key in SINK_DIRS:
        if getattr(config, key) and (found := Path(getattr(config, key)) / files[key]).exists():
            raise ConfigError(
                f"{key} = {getattr(config, key)!r} already holds {found.name} of an earlier "
                f"run: this peer's rows would go on after it; choose another --{key}, or give "
                "--resume to carry that run's peer on"
            )


def _hook(spec: str, run: RunDir, peer_id: int) -> Sink:
    """The user's ``module:function(peer_id, run_dir)``, called once; returns the sink."""
    factory = _hook_factory(spec)
    sink = call_plugin(
        factory, spec, "metrics_hook =", ConfigError, ("peer_id", peer_id), ("run_dir", run.root)
    )
    if not callable(sink):
        raise ConfigError(
            f"metrics_hook = {spec!r} returned {type(sink).__name__}, not a callable taking a "
            "metrics line (dict)"
        )
    return sink


class MetricsSinks:
    """Every sink the config asks for, fed one metrics line at a time."""

    def __init__(self, config: Config, run: RunDir, peer_id: int) -> None:
        self._closers: list[Callable[[], None]] = []
        self._sinks: list[Sink] = []
        self._hook: Sink | None = None
        self._spec = config.metrics_hook
        self._peer_id = peer_id
        self.hook_missed = 0  # lines the hook was not given after it failed
        try:
            if config.tensorboard:
                self._add(_TensorBoard(config.tensorboard, peer_id))
            if config.csv:
                self._add(_Csv(config.csv, peer_id))
            if config.metrics_hook:
                self._hook = _hook(config.metrics_hook, run, peer_id)
                self._sinks.append(self._hook)
                if callable(close := getattr(self._hook, "close", None)):
                    self._closers.append(close)
        except BaseException:
            self.close()
            raise

    def _add(self, sink: _TensorBoard | _Csv) -> None:
        self._sinks.append(sink)
        self._closers.append(sink.close)

    def write(self, line: dict[str, Any]) -> None:
        """Hand every sink its own copy of ``line`` as the jsonl holds it (NaN as None): a sink
        that edits it changes neither another's nor what the runner reads after. The user's
        hook failing must not end training: it is logged once and not called again."""
        self.hook_missed += bool(self.hook_missed)
        for sink in list(self._sinks):
            try:
                sink(json_safe(line))
            except Exception as exc:
                if sink is not self._hook:
                    raise
                self._sinks.remove(sink)
                self.hook_missed = 1
                log.error(
                    "peer %d: metrics_hook = %r failed on its line of step %s (%s: %s); it is "
                    "not called again, training goes on",
                    self._peer_id, self._spec, line.get("step"), type(exc).__name__, exc,
                    exc_info=True,
                )  # fmt: skip

    def close(self) -> None:
        """Flush and close every sink that holds a file; say how many lines a hook that
        failed missed."""
        if self.hook_missed:
            log.warning(
                "peer %d: metrics_hook = %r missed %d metrics line(s) after it failed",
                self._peer_id, self._spec, self.hook_missed,
            )  # fmt: skip
            self.hook_missed = 0
        for close in self._closers:
            close()
        self._closers.clear()
