"""The run directory, a public contract read by benchmarks, reports and external checks.

Layout (keys are only ever added, never renamed)::

    config.toml        the fully resolved config
    peers.json         [{"id", "address"}, ...] once the swarm is up (rewritten on joins;
                       mode ps: the workers shard 0 has heard from)
    peers/<id>.jsonl   one metrics object per line
    peers/<id>.log     the peer's log
    peers/<id>.lock    held (flock) by the process running peer <id>, so no second one can
    servers/<k>.json   parameter-server shard k's counters (mode ps), rewritten as it runs
    servers/<k>.log    that shard's log
    models/<id>.pt     the peer's final model (state_dict)
    checkpoints/<id>.pt  the peer's latest checkpoint (checkpoint_every > 0), for --resume
    summary.json       totals and per-peer results, written at the end
    report/            `gossipdl report`: accuracy.png, timeline.png, report.md

A sweep (`gossipdl sweep`) writes one run directory per variant under its
own directory, with ``sweep.json`` ({"grid", "variants": [{"name",
"settings", "run_dir", results or "error"}]}) and ``report/`` (the variants
overlaid in accuracy.png, timeline-<variant>.png each, report.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import math
import os
import socket
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from gossipdl.config import ConfigError
from gossipdl.experiments.orphans import process_exists
from gossipdl.numerals import is_decimal

# The unix time a launcher started the run; every peer it starts counts ``time`` from it.
RUN_START_ENV = "GOSSIPDL_RUN_START"


def default_run_dir() -> Path:
    """``runs/<timestamp>`` under the current directory."""
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def complete_lines(path: Path) -> list[bytes]:
    """The lines of a file that is being appended to, up to its last newline: a line still
    being written (its newline not there yet) is not one of them, whatever bytes it has."""
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1].splitlines()


def parse_records(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The metrics objects among complete lines, for every reader alike: a line that is not
    UTF-8 JSON of an object (cut, hand-edited, written by something else) is skipped."""
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # JSON or UTF-8 broken
            continue
        if isinstance(record, dict):
            yield record


def number(record: Mapping[str, Any], key: str) -> float | None:
    """``record[key]`` if it is a finite number, else None: a writer makes a non-finite
    number null (:func:`json_safe`), an older one lacks newer keys, and a reader takes
    either as absent instead of failing on it."""
    value = record.get(key)
    if isinstance(value, int | float) and math.isfinite(value):
        return value
    return None


def counter(record: Mapping[str, Any], key: str) -> float:
    """A counter of a metrics line (``bytes_sent``, ``idle_s``, ``time``...), 0 where it is
    absent (:func:`number`)."""
    value = number(record, key)
    return 0 if value is None else value


CARRIED = (
    "bytes_sent",
    "header_bytes_sent",
    "bytes_received",
    "messages_sent",
    "messages_received",
    "handshakes_refused",
    "model_messages_sent",
    "syncs",
    "neighbour_misses",
    "resyncs",
    "idle_s",
    "declared_dead",
    "rejoins",
)
"""Counters that sum over a peer's lives: one resumed from a checkpoint carries them on from
its last life, one started afresh counts from 0 (the other keys of a metrics line are states,
not sums)."""


class RunDirError(ValueError):
    """A file of a run directory that cannot be read; the message names it and what to do."""


def read_json(path: Path) -> Any:
    """A JSON file of a run directory; a torn or hand-edited one is a RunDirError naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{path} is not readable JSON ({exc}); re-run, or restore it") from None


def cut_to_last_line(path: Path, chunk: int = 1 << 16) -> None:
    """Cut a file being appended to back to its last newline (empty if it has none): a line
    a killed writer left half written, which the next writer's first line would join, and
    every reader skip both."""
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        start = end
        while start > 0:
            start = max(0, start - chunk)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
        f.truncate(0)


def json_safe(value: Any) -> Any:
    """``value`` with every NaN and ±Inf float (a diverged run's loss, consensus distance)
    made None: JSON has no such numbers, and ``json.dumps`` writes the bare ``NaN`` that
    strict readers refuse.

    Example:
        >>> json_safe({"loss": float("nan"), "acc": [0.5, float("inf")]})
        {'loss': None, 'acc': [0.5, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON of ``value`` (:func:`json_safe`): every file and line gossipdl writes."""
    return json.dumps(json_safe(value), allow_nan=False, **options)


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON so readers never see a half-written file (:func:`write_text_atomic`)."""
    write_text_atomic(path, dumps(value, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` so readers never see a half-written file (:func:`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(text)


_rewrites = itertools.count()  # a process's temporary files apart: its threads rewrite at once
_cleared: set[Path] = set()  # directories whose leftovers this process has cleared


def temporary_beside(path: Path) -> Path:
    """A fresh name for the temporary file of a rewrite of ``path`` (``.NAME~PID~N~HOST.tmp``).

    A process's first one in a directory clears what writers killed mid-write left there:
    files as large as the ones they rewrote, kept for good before. Only this machine's
    writers that no longer run are cleared (another machine's, on a shared disk, may still
    be writing), and once per process and directory: a 10,000-peer simulation saves 10,000
    models into one."""
    host, folder = socket.gethostname(), path.parent.absolute()
    if folder not in _cleared:
        _cleared.add(folder)
        for left in folder.glob(".*~*~*~*.tmp"):
            _, pid, _, writer_host = left.name.removesuffix(".tmp").rsplit("~", 3)
            if writer_host == host and pid.isdigit() and not process_exists(int(pid)):
                left.unlink(missing_ok=True)
    return path.with_name(f".{path.name}~{os.getpid()}~{next(_rewrites)}~{host}.tmp")


@contextlib.contextmanager
def atomic_file(path: Path, newline: str | None = None) -> Iterator[IO[str]]:
    """A text file that replaces ``path`` when the block ends (tmp + rename), so readers never
    see it half written and a kill leaves the old one whole. Each call has its own tmp file
    (:func:`temporary_beside`): a peer's threads and the peers of a run rewrite one file at
    once."""
    tmp = temporary_beside(path)
    try:
        with open(tmp, "x", newline=newline) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RunDir:
    """Paths of one run directory; creating it makes the sub-folders."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def create(self) -> RunDir:
        """Make the directory tree (idempotent); ConfigError naming ``out`` where it cannot be
        made (a file on the path, no permission, a full disk)."""
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"out = {str(self.root)!r} is a file; name a directory for the run")
        try:
            (self.root / "peers").mkdir(parents=True, exist_ok=True)
            (self.root / "models").mkdir(exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"out = {str(self.root)!r}: cannot create it ({exc})") from None
        return self

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def peers_json(self) -> Path:
        return self.root / "peers.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def metrics(self, peer_id: int) -> Path:
        return self.root / "peers" / f"{peer_id}.jsonl"

    def append_metrics(self, peer_id: int) -> IO[str]:
        """Peer ``peer_id``'s metrics file, line-buffered for appending (a resumed peer
        carries on in it), cut back first to its last complete line
        (:func:`cut_to_last_line`)."""
        path = self.metrics(peer_id)
        if path.exists():
            cut_to_last_line(path)
        return path.open("a", buffering=1)

    def log(self, peer_id: int | str) -> Path:
        return self.root / "peers" / f"{peer_id}.log"

    def hold(self, peer_id: int) -> IO[bytes]:
        """Lock ``peers/<id>.lock`` until the handle is closed (the kernel lets go when the
        process exits, however it dies): ConfigError if another holder has it, as
        a second ``--resume`` of a rank whose first life still runs would, writing both lives'
        lines into one metrics file and one checkpoint."""
        path = self.root / "peers" / f"{peer_id}.lock"
        handle = path.open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConfigError(
                f"peer {peer_id} of {self.root} is still running (a process holds {path}); "
                "stop it before resuming that rank, or choose another --out"
            ) from None
        return handle

    def server_stats(self, shard: int) -> Path:
        return self.root / "servers" / f"{shard}.json"

    def server_log(self, shard: int) -> Path:
        return self.root / "servers" / f"{shard}.log"

    def server_shards(self) -> list[int]:
        """Shards that wrote counters, sorted."""
        return self._ids("servers", ".json")

    def model(self, peer_id: int) -> Path:
        return self.root / "models" / f"{peer_id}.pt"

    def checkpoint(self, peer_id: int) -> Path:
        return self.root / "checkpoints" / f"{peer_id}.pt"

    def write_members(self, members: Iterable[tuple[int, str]]) -> None:
        """Rewrite ``peers.json`` with these ``(id, address)`` pairs, sorted by id."""
        write_json_atomic(self.peers_json, [{"id": i, "address": a} for i, a in sorted(members)])

    def member_addresses(self) -> dict[int, str]:
        """Id -> address of the members ``peers.json`` lists ({} if there is none yet)."""
        try:
            entries = json.loads(self.peers_json.read_text())
            return {int(e["id"]): str(e["address"]) for e in entries}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def peer_ids(self) -> list[int]:
        """Ids of the peers that wrote metrics, sorted."""
        return self._ids("peers", ".jsonl")

    def _ids(self, folder: str, suffix: str) -> list[int]:
        """The ids of the files ``folder/<id><suffix>``, sorted. Only a name that is its id's
        own decimal form counts (``3``; not ``03``, where the id's path would not lead):
        like a name that is no number, any other is skipped as not the run's."""
        stems = (p.name.removesuffix(suffix) for p in (self.root / folder).glob(f"*{suffix}"))
        return sorted(int(s) for s in stems if is_decimal(s) and str(int(s)) == s)

    def last_record(self, peer_id: int) -> dict[str, Any] | None:
        """The last complete metrics line of peer ``peer_id`` (None: it wrote none)."""
        if not self.metrics(peer_id).is_file():
            return None
        last = deque(self.records(peer_id), maxlen=1)
        return last[0] if last else None

    def records(self, peer_id: int) -> Iterator[dict[str, Any]]:
        """The metrics lines of one peer, parsed (:func:`parse_records`): a line still being
        written (a live run's last, no newline yet) is not one of them."""
        yield from parse_records(complete_lines(self.metrics(peer_id)))
