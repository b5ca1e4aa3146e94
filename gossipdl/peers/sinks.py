"""Where a peer's metrics lines go besides ``peers/<id>.jsonl``: TensorBoard, CSV, a user hook.

Each sink gets every line the runner writes, as the same dict. gossipdl
depends on neither TensorBoard nor anything else here: ``tensorboard`` is
imported only when asked for, and a missing package is a clear error before
training starts. A hook is the user's own code, named in their own config
(a swarm's config from another peer can never set it: ``gossipdl.trust``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gossipdl.config import Config, ConfigError
from gossipdl.plugins import call_plugin, load_callable
from gossipdl.rundir import RunDir

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
    keys seen so far; a line with a new key rewrites the file once with the wider header
    (the rows are read back from the file, not kept in memory)."""

    def __init__(self, root: str, peer_id: int) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.path = Path(root) / f"{peer_id}.csv"
        self._columns: list[str] = []
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None

    def __call__(self, line: dict[str, Any]) -> None:
        row = {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in line.items()}
        new = [k for k in row if k not in self._columns]
        if new or self._writer is None:
            rows = []
            if self._file is not None:
                self._file.close()
            if self.path.is_file():  # ours so far, or a resumed peer's first life
                with self.path.open(newline="") as f:
                    reader = csv.DictReader(f)
                    rows = list(reader)
                    self._columns = list(reader.fieldnames or [])
                new = [k for k in row if k not in self._columns]
            self._columns += new
            self._file = self.path.open("w", newline="", buffering=1)
            self._writer = csv.DictWriter(self._file, self._columns, restval="")
            self._writer.writeheader()
            self._writer.writerows(rows)
        self._writer.writerow(row)

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
    """Fail now, before the peer joins anyone, if a sink the config asks for cannot work
    (tensorboard not installed, a hook that does not import)."""
    if config.tensorboard:
        _summary_writer(config.tensorboard)
    if config.metrics_hook:
        _hook_factory(config.metrics_hook)


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
        try:
            if config.tensorboard:
                self._add(_TensorBoard(config.tensorboard, peer_id))
            if config.csv:
                self._add(_Csv(config.csv, peer_id))
            if config.metrics_hook:
                hook = _hook(config.metrics_hook, run, peer_id)
                self._sinks.append(hook)
                if callable(close := getattr(hook, "close", None)):
                    self._closers.append(close)
        except BaseException:
            self.close()
            raise

    def _add(self, sink: _TensorBoard | _Csv) -> None:
        self._sinks.append(sink)
        self._closers.append(sink.close)

    def write(self, line: dict[str, Any]) -> None:
        """Hand ``line`` to every sink."""
        for sink in self._sinks:
            sink(line)

    def close(self) -> None:
        """Flush and close every sink that holds a file."""
        for close in self._closers:
            close()
        self._closers.clear()
