"""Turn a run's per-peer metrics and final models into ``summary.json`` and accuracy curves.

The readers here take a :class:`Run`, the peers of one run read from one or
more run directories (``gossipdl peer``/``join`` on each machine of a swarm
write their own), or a single :class:`~gossipdl.rundir.RunDir`.
"""

from __future__ import annotations

import pickle
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gossipdl.config import load_config, to_dict
from gossipdl.experiments.provenance import provenance
from gossipdl.rundir import (
    CARRIED,
    RunDir,
    RunDirError,
    counter,
    number,
    read_json,
    write_json_atomic,
)


class Run:
    """The peers of one run, read from one or more run directories as if they were one (a
    swarm whose machines each wrote their own directory)."""

    def __init__(self, *dirs: RunDir) -> None:
        self.dirs = dirs

    def peer_ids(self) -> list[int]:
        """Ids of the peers that wrote metrics in any of the directories, sorted."""
        return sorted({peer_id for d in self.dirs for peer_id in d.peer_ids()})

    def records(self, peer_id: int) -> Iterator[dict[str, Any]]:
        """One peer's metrics lines (a torn last line is skipped); a peer that wrote in several
        directories (resumed on another machine) reads as its lives in the order they began."""
        lives = [list(d.records(peer_id)) for d in self.dirs if d.metrics(peer_id).is_file()]
        for life in sorted(lives, key=lambda lines: counter(lines[0], "unix_time") if lines else 0):
            yield from life

    def model(self, peer_id: int) -> Path | None:
        """The peer's final model file, None if no directory holds one."""
        return next((d.model(peer_id) for d in self.dirs if d.model(peer_id).is_file()), None)

    def servers(self) -> list[dict[str, Any]]:
        """The parameter-server shards' counters (mode ps), from every directory."""
        return [
            {"shard": k, **read_json(d.server_stats(k))}
            for d in self.dirs
            for k in d.server_shards()
        ]


def view(run: Run | RunDir) -> Run:
    """``run`` as a :class:`Run` (a single directory becomes a one-directory view)."""
    return run if isinstance(run, Run) else Run(run)


def consensus_distance(run: Run | RunDir, peer_ids: list[int]) -> float | None:
    """Mean squared distance of the final models to their average, (1/n) Σ ||x_i − x̄||².

    None when fewer than two final models were saved.
    """
    paths = list(filter(None, map(view(run).model, peer_ids)))
    vectors = [_parameters(path) for path in paths]
    if len(vectors) < 2:
        return None
    size = Counter(v.numel() for v in vectors).most_common(1)[0][0]
    for path, vector in zip(paths, vectors, strict=True):
        if vector.numel() != size:
            raise RunDirError(
                f"{path} holds {vector.numel()} parameters, the other models {size}: not the "
                "same model; restore it, or delete it to leave that peer out of the consensus "
                "distance"
            )
    stacked = torch.stack(vectors)
    return float(((stacked - stacked.mean(0)) ** 2).sum(1).mean())


def _parameters(path: Path) -> torch.Tensor:
    """A final model's parameters as one vector; a file that is no state_dict of tensors
    (torn, empty, written by something else) is a RunDirError naming it, not a traceback."""
    try:
        if path.stat().st_size == 0:
            raise ValueError("an empty file")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(map(torch.is_tensor, state.values())):
            raise ValueError(f"a {type(state).__name__}, not a state_dict of tensors")
        return torch.cat([t.reshape(-1).double() for t in state.values()])
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise RunDirError(
            f"{path} is not a readable model ({why}); restore it, or delete it to leave that "
            "peer out of the consensus distance"
        ) from None


LIFE_COUNTERS = (*CARRIED, "messages_dropped")
"""The counters of a metrics line :func:`over_lives` adds up across a peer's lives."""


def _reasons(record: dict[str, Any]) -> Counter[str]:
    """A line's ``dropped_reasons`` (entries that are no numbers left out)."""
    reasons = record.get("dropped_reasons")
    if not isinstance(reasons, dict):
        return Counter()
    return Counter({k: v for k, v in reasons.items() if number(reasons, k) is not None})


class Lives:
    """One peer's counters summed over its lives a line at a time (:func:`over_lives`), so a
    reader of a live run (the launcher's display) counts as ``summary.json`` does."""

    def __init__(self) -> None:
        self._earlier: Counter[str] = Counter()  # the finished lives' sums
        self._reasons: Counter[str] = Counter()
        self._latest: dict[str, float] = {}  # this life's latest value of each counter
        self._latest_reasons: Counter[str] = Counter()

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with its counters raised by the peer's earlier lives' (the next line
        of the peer's file; ``record`` itself is left as it is)."""
        if record.get("start") and record.get("resumed") is not True:
            self._earlier.update(self._latest)
            self._reasons.update(self._latest_reasons)
            self._latest, self._latest_reasons = {}, Counter()
        values = {k: v for k in LIFE_COUNTERS if (v := number(record, k)) is not None}
        self._latest.update(values)
        self._latest_reasons = _reasons(record) or self._latest_reasons
        if self._earlier or self._reasons:
            record = {**record, **{k: v + self._earlier[k] for k, v in values.items()}}
            if self._reasons:
                record["dropped_reasons"] = dict(self._reasons + _reasons(record))
        return record


def over_lives(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One peer's lines with the counters of a life that counted them from 0 again (its
    ``start`` line does not say ``"resumed": true``: restarted without a checkpoint) raised
    by its earlier lives' last values, so a total or curve read from a line counts every
    life; a life resumed from a checkpoint carried them on itself."""
    lives = Lives()
    return [lives.add(record) for record in records]


def peer_lines(run: Run | RunDir) -> dict[int, list[dict[str, Any]]]:
    """Each peer's metrics lines, its counters summed over its lives (:func:`over_lives`); a
    peer with none yet (only a torn first line) is left out."""
    run = view(run)
    lines = {peer_id: over_lives(list(run.records(peer_id))) for peer_id in run.peer_ids()}
    return {peer_id: records for peer_id, records in lines.items() if records}


def startup_time(lines: dict[int, list[dict[str, Any]]]) -> float:
    """Seconds from the swarm's start until its last peer began training: the latest ``time``
    of the peers' first ``start`` lines (0.0 when no peer wrote one)."""
    starts = (
        next((counter(r, "time") for r in records if r.get("start")), None)
        for records in lines.values()
    )
    return max((t for t in starts if t is not None), default=0.0)


def device_curve(summary: dict[str, Any]) -> list[dict[str, float]]:
    """Each device's accuracy on its own test data (``own_accuracy``, natural splits),
    worst first, at ``share`` (its place in the swarm, from 0 to 1, so swarms of any size
    compare); empty when the run has none."""
    own = sorted(p["own_accuracy"] for p in summary["peers"] if p.get("own_accuracy") is not None)
    return [{"share": (k + 0.5) / len(own), "own_accuracy": a} for k, a in enumerate(own)]


def evaluations(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One peer's evaluations in file order, each at a later step than the one before: a life
    restarted from an earlier step replays steps its earlier life evaluated, with another
    model and later, and the earlier life's evaluations stand for them (time runs forward)."""
    kept: list[dict[str, Any]] = []
    for record in records:
        step = number(record, "step")
        if number(record, "accuracy") is None or step is None:
            continue
        if not kept or step > kept[-1]["step"]:
            kept.append(record)
    return kept


def accuracy_curve(run: Run | RunDir) -> list[dict[str, float]]:
    """Mean test accuracy over the peers at every step any of them evaluated, with the cost so far.

    A peer that did not evaluate at that step counts with its latest evaluation
    before it (away, it skipped evaluations while catching up its step count;
    dead, it evaluates no more: its model is the one it last evaluated), so
    one absent peer does not drop the step or end the curve; a peer with no
    evaluation yet (not joined) is left out. Each peer's evaluations are
    :func:`evaluations` (a restarted life's replay skipped). One point per
    step: ``step``, ``time_s`` (seconds since the swarm's start when the last
    peer to evaluate at it or at an earlier step did: a peer late with an
    earlier step moves the time of the later ones too), ``training_s`` (the same, less the run's
    start-up time), ``bytes_sent`` and ``messages_sent`` (model
    transmissions; both summed over the counted peers' evaluations, every
    life of a peer counted: :func:`peer_lines`; in mode ps ``bytes_sent``
    also holds the parameter servers' bytes, as the workers had received
    them, ``bytes_received``: a shard's own counters have no steps) and
    ``accuracy`` (their mean). Feeds the accuracy-vs-bytes plots.
    """
    run = view(run)
    servers = any(d.server_shards() for d in run.dirs)  # their bytes reach only the workers
    lines = peer_lines(run)
    startup = startup_time(lines)
    at_step: dict[float, dict[int, dict[str, Any]]] = {}
    for peer_id, records in lines.items():
        for record in evaluations(records):
            at_step.setdefault(record["step"], {})[peer_id] = record
    latest: dict[int, dict[str, Any]] = {}
    curve: list[dict[str, float]] = []
    curve_time: list[float] = []  # the last point's time: a later step's is no earlier
    for step, evaluated in sorted(at_step.items()):
        latest.update(evaluated)
        counted = latest.values()
        time_s = max([counter(r, "time") for r in evaluated.values()] + curve_time)
        curve_time = [time_s]
        curve.append(
            {
                "step": step,
                "time_s": time_s,
                "training_s": time_s - startup,
                "bytes_sent": sum(
                    counter(r, "bytes_sent") + (counter(r, "bytes_received") if servers else 0)
                    for r in counted
                ),
                "messages_sent": sum(counter(r, "model_messages_sent") for r in counted),
                "accuracy": sum(r["accuracy"] for r in counted) / len(counted),
            }
        )
    return curve


def mean_curve(curves: Sequence[Sequence[dict[str, float]]]) -> list[dict[str, float]]:
    """Several runs' curves (seeds) as one: at every step all of them reached, each key's mean
    and, as ``<key>_std``, its sample standard deviation (the band a plot shades).

    Example:
        >>> point = mean_curve([[{"step": 1, "accuracy": 0.5}], [{"step": 1, "accuracy": 0.7}]])[0]
        >>> round(point["accuracy"], 3), round(point["accuracy_std"], 3)
        (0.6, 0.141)
    """
    if len(curves) < 2:
        return [dict(point) for curve in curves for point in curve]
    by_step = [{point["step"]: point for point in curve} for curve in curves]
    steps = sorted(set.intersection(*(set(points) for points in by_step)))
    mean = []
    for step in steps:
        points = [points[step] for points in by_step]
        mean.append(
            {
                name: value
                for key in points[0]
                for name, value in (
                    (key, statistics.fmean(p[key] for p in points)),
                    (f"{key}_std", statistics.stdev(p[key] for p in points)),
                )
            }
        )
    return mean


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    """The latest number under ``key`` (:func:`~gossipdl.rundir.number`: a hand-edited or
    foreign line's text is skipped like a null)."""
    return next((v for r in reversed(records) if (v := number(r, key)) is not None), None)


SUSPECT_SHARE, SUSPECT_DISTANCE = 0.25, 3.0
"""A neighbour looks wrong when the defences set it aside in at least ``SUSPECT_SHARE`` of
its rounds and twice as often as the median neighbour, or when its mean distance to the
models of the peers that judged it is ``SUSPECT_DISTANCE`` times the median one."""


def _judged_per_life(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each life's latest ``neighbours`` record of one peer's lines, a life beginning at a
    ``start`` line: a peer's judge counts from 0 in every life, resumed from a checkpoint or
    not (the checkpoint holds no verdicts)."""
    lives: list[dict[str, Any]] = []
    latest: dict[str, Any] = {}
    for record in records:
        if record.get("start") and latest:
            lives.append(latest)
            latest = {}
        if isinstance(record.get("neighbours"), dict):
            latest = record["neighbours"]
    return [*lives, latest] if latest else lives


def judged_neighbours(lines: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What the peers' defences saw of each neighbour over the run (each peer's latest
    ``neighbours`` record of each of its lives, added up): per neighbour ``id``, the peers
    that ``judged`` it, its ``rounds``, its mean ``distance`` to their models and the share
    ``filtered`` (set aside), both weighted by rounds, and ``suspect`` (see
    :data:`SUSPECT_SHARE`). Most suspect first; empty when no peer ran a defence. Entries
    that are not numbers are skipped: a reader of a live run directory takes what it can."""
    sums: dict[int, list[float]] = {}  # id -> [judges, rounds, Σ rounds·distance, Σ rounds·share]
    for records in lines.values():
        judges: set[int] = set()  # the neighbours this peer judged, in any of its lives
        for latest in _judged_per_life(records):
            for key, seen in latest.items():
                try:
                    j, n = int(key), float(seen["rounds"])
                    distance, share = float(seen["distance"]), float(seen["filtered"])
                except (KeyError, TypeError, ValueError):
                    continue
                if n > 0:
                    total = sums.setdefault(j, [0, 0.0, 0.0, 0.0])
                    total[0] += j not in judges
                    judges.add(j)
                    total[1] += n
                    total[2] += n * distance
                    total[3] += n * share
    rows = [
        {"id": j, "judged": int(k), "rounds": int(n), "distance": d / n, "filtered": f / n}
        for j, (k, n, d, f) in sums.items()
    ]
    if rows:
        share = statistics.median(r["filtered"] for r in rows)
        distance = statistics.median(r["distance"] for r in rows)
        for r in rows:
            r["suspect"] = (
                r["filtered"] >= max(SUSPECT_SHARE, 2 * share)
                or r["distance"] >= SUSPECT_DISTANCE * distance > 0
            )
    return sorted(rows, key=lambda r: (not r["suspect"], -r["filtered"], -r["distance"], r["id"]))


def summary_of(run: Run | RunDir, wall_time_s: float | None = None) -> dict[str, Any]:
    """Totals and per-peer results of ``run``, from whatever its peers wrote (nothing written).

    ``wall_time_s`` (default: the last peer's last ``time``) splits into
    ``startup_s`` (until the last peer began training) and ``training_s``.
    """
    run = view(run)
    lines = peer_lines(run)
    peers = []
    for peer_id, records in lines.items():
        last = records[-1]
        peers.append(
            {
                "id": peer_id,
                "accuracy": _last(records, "accuracy"),
                "own_accuracy": _last(records, "own_accuracy"),  # natural splits only
                "bytes_sent": counter(last, "bytes_sent"),
                "header_bytes_sent": counter(last, "header_bytes_sent"),
                "bytes_received": counter(last, "bytes_received"),
                "messages_sent": counter(last, "model_messages_sent"),
                "socket_messages_sent": counter(last, "messages_sent"),
                "syncs": counter(last, "syncs"),
                "messages_dropped": counter(last, "messages_dropped"),
                "dropped_reasons": last.get("dropped_reasons", {}),
                "steps": counter(last, "step"),
                "finished": bool(last.get("final")) and not last.get("stopped_early", False),
                "loss": _last(records, "loss"),
                "idle_s": counter(last, "idle_s"),
                "neighbour_misses": counter(last, "neighbour_misses"),
                "time_s": counter(last, "time"),
                "device": last.get("device"),
            }
        )
    servers = run.servers()
    server_bytes = sum(counter(s, "bytes_sent") for s in servers)
    accuracies = [p["accuracy"] for p in peers if p["accuracy"] is not None]
    own = [p["own_accuracy"] for p in peers if p["own_accuracy"] is not None]
    finished = [p["accuracy"] for p in peers if p["finished"] and p["accuracy"] is not None]
    if wall_time_s is None:
        wall_time_s = max((p["time_s"] for p in peers), default=0.0)
    startup_s = startup_time(lines)
    return {
        "mean_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
        # the peers that ran to the end (after a peer died, the mean above includes its
        # last evaluation)
        "mean_accuracy_finished": sum(finished) / len(finished) if finished else None,
        "min_accuracy": min(accuracies, default=None),
        "max_accuracy": max(accuracies, default=None),
        # natural splits: each device's accuracy on its own data, across the devices
        "mean_own_accuracy": sum(own) / len(own) if own else None,
        "min_own_accuracy": min(own, default=None),
        "max_own_accuracy": max(own, default=None),
        "consensus_distance": consensus_distance(run, [p["id"] for p in peers]),
        "total_bytes_sent": sum(p["bytes_sent"] for p in peers) + server_bytes,
        "total_header_bytes_sent": sum(p["header_bytes_sent"] for p in peers)
        + sum(counter(s, "header_bytes_sent") for s in servers),
        "server_bytes_sent": server_bytes,
        "total_bytes_received": sum(p["bytes_received"] for p in peers),
        "total_messages_sent": sum(p["messages_sent"] for p in peers),
        "total_socket_messages_sent": sum(p["socket_messages_sent"] for p in peers),
        "total_messages_dropped": sum(p["messages_dropped"] for p in peers),
        "wall_time_s": wall_time_s,
        "startup_s": startup_s,
        "training_s": wall_time_s - startup_s,
        "peers_finished": sum(p["finished"] for p in peers),
        # ids the defences' per-neighbour statistics single out (judged_neighbours)
        "suspect_neighbours": [r["id"] for r in judged_neighbours(lines) if r["suspect"]],
        "peers": peers,
        "servers": servers,
    }


def summarize(run: RunDir, wall_time_s: float | None = None) -> dict[str, Any]:
    """Compute and write ``summary.json`` from whatever the peers wrote, with the config and
    the provenance (versions, commit, host, devices, command line) of this process."""
    summary = summary_of(run, wall_time_s)
    summary["config"] = to_dict(load_config(run.config)) if run.config.is_file() else None
    summary["provenance"] = provenance(p["device"] for p in summary["peers"] if p["device"])
    write_json_atomic(run.summary, summary)
    return summary
