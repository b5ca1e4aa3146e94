"""Turn a run directory's per-peer metrics and final models into ``summary.json``."""

from __future__ import annotations

import json
from typing import Any

import torch

from gossipdl.config import load_config, to_dict
from gossipdl.rundir import RunDir, write_json_atomic


def consensus_distance(run: RunDir, peer_ids: list[int]) -> float | None:
    """Mean squared distance of the final models to their average, (1/n) Σ ||x_i − x̄||².

    None when fewer than two final models were saved.
    """
    vectors = []
    for peer_id in peer_ids:
        path = run.model(peer_id)
        if path.is_file():
            state = torch.load(path, map_location="cpu", weights_only=True)
            vectors.append(torch.cat([t.reshape(-1).double() for t in state.values()]))
    if len(vectors) < 2:
        return None
    stacked = torch.stack(vectors)
    return float(((stacked - stacked.mean(0)) ** 2).sum(1).mean())


def accuracy_curve(run: RunDir) -> list[dict[str, float]]:
    """Mean test accuracy over the peers at every step all of them evaluated, with the cost so far.

    One point per such step: ``step``, ``time_s`` (the slowest peer's seconds
    since its start), ``bytes_sent`` and ``messages_sent`` (model
    transmissions; both summed over the peers, up to that step) and
    ``accuracy`` (the peers' mean). Feeds the accuracy-vs-bytes plots.
    """
    evaluations: dict[int, dict[int, dict[str, Any]]] = {}
    peer_ids = run.peer_ids()
    for peer_id in peer_ids:
        for record in run.records(peer_id):
            if record.get("accuracy") is not None:
                evaluations.setdefault(record["step"], {})[peer_id] = record
    return [
        {
            "step": step,
            "time_s": max(r.get("time", 0.0) for r in by_peer.values()),
            "bytes_sent": sum(r.get("bytes_sent", 0) for r in by_peer.values()),
            "messages_sent": sum(r.get("model_messages_sent", 0) for r in by_peer.values()),
            "accuracy": sum(r["accuracy"] for r in by_peer.values()) / len(by_peer),
        }
        for step, by_peer in sorted(evaluations.items())
        if len(by_peer) == len(peer_ids)
    ]


def _last(records: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def summarize(run: RunDir, wall_time_s: float | None = None) -> dict[str, Any]:
    """Compute and write ``summary.json`` from whatever the peers wrote."""
    peers = []
    for peer_id in run.peer_ids():
        records = list(run.records(peer_id))
        if not records:
            continue
        last = records[-1]
        peers.append(
            {
                "id": peer_id,
                "accuracy": _last(records, "accuracy"),
                "bytes_sent": last.get("bytes_sent", 0),
                "header_bytes_sent": last.get("header_bytes_sent", 0),
                "bytes_received": last.get("bytes_received", 0),
                "messages_sent": last.get("model_messages_sent", 0),
                "socket_messages_sent": last.get("messages_sent", 0),
                "syncs": last.get("syncs", 0),
                "messages_dropped": last.get("messages_dropped", 0),
                "dropped_reasons": last.get("dropped_reasons", {}),
                "steps": last.get("step", 0),
                "finished": bool(last.get("final")) and not last.get("stopped_early", False),
                "loss": _last(records, "loss"),
                "idle_s": last.get("idle_s", 0.0),
                "neighbour_misses": last.get("neighbour_misses", 0),
                "time_s": last.get("time", 0.0),
            }
        )
    servers = [
        {"shard": k, **json.loads(run.server_stats(k).read_text())} for k in run.server_shards()
    ]
    server_bytes = sum(s.get("bytes_sent", 0) for s in servers)
    accuracies = [p["accuracy"] for p in peers if p["accuracy"] is not None]
    finished = [p["accuracy"] for p in peers if p["finished"] and p["accuracy"] is not None]
    summary = {
        "mean_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
        # the peers that ran to the end (after a peer died, the mean above includes its
        # last evaluation)
        "mean_accuracy_finished": sum(finished) / len(finished) if finished else None,
        "min_accuracy": min(accuracies, default=None),
        "max_accuracy": max(accuracies, default=None),
        "consensus_distance": consensus_distance(run, [p["id"] for p in peers]),
        "total_bytes_sent": sum(p["bytes_sent"] for p in peers) + server_bytes,
        "total_header_bytes_sent": sum(p["header_bytes_sent"] for p in peers)
        + sum(s.get("header_bytes_sent", 0) for s in servers),
        "server_bytes_sent": server_bytes,
        "total_bytes_received": sum(p["bytes_received"] for p in peers),
        "total_messages_sent": sum(p["messages_sent"] for p in peers),
        "total_socket_messages_sent": sum(p["socket_messages_sent"] for p in peers),
        "total_messages_dropped": sum(p["messages_dropped"] for p in peers),
        "wall_time_s": wall_time_s
        if wall_time_s is not None
        else max((p["time_s"] for p in peers), default=0.0),
        "peers_finished": sum(p["finished"] for p in peers),
        "peers": peers,
        "servers": servers,
        "config": to_dict(load_config(run.config)) if run.config.is_file() else None,
    }
    write_json_atomic(run.summary, summary)
    return summary
