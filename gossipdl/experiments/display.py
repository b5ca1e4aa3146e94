"""What a person sees: a live per-peer progress display, the device profiles, and the final
results tables of a run and of a sweep."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gossipdl.conditions import parse_profile, parse_profiles
from gossipdl.config import Config
from gossipdl.rundir import RunDir, counter, number, parse_records


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB' (decimal units, as network rates are quoted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


class LiveProgress:
    """Tails ``peers/<id>.jsonl`` and shows each peer's step, loss and bytes sent."""

    def __init__(
        self, run: RunDir, steps: int, console: Console | None = None, enabled: bool = True
    ) -> None:
        self._run = run
        self._enabled = enabled
        self._steps = steps
        self._offsets: dict[int, int] = {}
        self._tasks: dict[int, Any] = {}
        self.progress = Progress(
            TextColumn("[bold]peer {task.fields[peer]:>3}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("sent {task.fields[sent]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def __enter__(self) -> LiveProgress:
        if self._enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self.refresh()
            self.progress.stop()

    def refresh(self) -> None:
        """Read new metrics lines and update the bars (nothing when disabled)."""
        if not self._enabled:
            return
        for peer_id in self._run.peer_ids():
            path = self._run.metrics(peer_id)
            offset = self._offsets.get(peer_id, 0)
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[peer_id] = offset + len(complete)
            for record in parse_records(complete.splitlines()):
                self._update(peer_id, record)

    def _update(self, peer_id: int, record: dict[str, Any]) -> None:
        task = self._tasks.get(peer_id)
        if task is None:
            task = self._tasks[peer_id] = self.progress.add_task(
                "", total=self._steps, peer=peer_id, loss="-", acc="-", sent="-"
            )
        fields: dict[str, Any] = {"sent": human_bytes(counter(record, "bytes_sent"))}
        for key, field in (("loss", "loss"), ("accuracy", "acc")):
            if (value := number(record, key)) is not None:
                fields[field] = f"{value:.3f}"
        self.progress.update(task, completed=counter(record, "step"), **fields)


def summary_table(summary: dict[str, Any], title: str = "gossipdl run") -> Table:
    """Per-peer accuracy, bytes and messages, with the swarm totals in the caption; on a
    natural split also each device's accuracy on its own data, and their spread."""
    table = Table(title=title)
    own = summary.get("mean_own_accuracy") is not None
    columns = ("steps", "sent", "received", "msgs sent", "dropped", "idle s")
    for name in ("peer", "test acc", *(["own-data acc"] if own else []), *columns):
        table.add_column(name, justify="right")
    for p in summary["peers"]:
        accuracies = [p["accuracy"], *([p.get("own_accuracy")] if own else [])]
        table.add_row(
            str(p["id"]),
            *("-" if a is None else f"{a:.4f}" for a in accuracies),
            str(p["steps"]),
            human_bytes(p["bytes_sent"]),
            human_bytes(p["bytes_received"]),
            str(p["messages_sent"]),
            str(p["messages_dropped"]),
            f"{p['idle_s']:.1f}",
        )
    mean = summary["mean_accuracy"]
    cd = summary["consensus_distance"]
    parts = [f"mean test accuracy {'-' if mean is None else f'{mean:.4f}'}"]
    if own:
        parts.append(
            f"own-data accuracy {summary['mean_own_accuracy']:.4f} "
            f"({summary['min_own_accuracy']:.4f} to {summary['max_own_accuracy']:.4f})"
        )
    parts += [
        f"consensus distance {'-' if cd is None else f'{cd:.3g}'}",
        f"sent {human_bytes(summary['total_bytes_sent'])}",
        f"start-up {summary['startup_s']:.1f} s + training {summary['training_s']:.1f} s",
        f"{summary['peers_finished']}/{len(summary['peers'])} peers finished",
    ]
    table.caption = " · ".join(parts)
    return table


def unreached_windows(config: Config, summary: dict[str, Any]) -> list[str]:
    """A line for each offline window that training ended before or during: a churn
    experiment whose windows never came tests nothing (the run is counted in steps, so
    this is known only afterwards)."""
    trained = {p["id"]: p["time_s"] for p in summary["peers"]}
    lines = []
    for peer_id, profile in sorted(parse_profiles(config.profiles, config.peers).items()):
        if peer_id not in trained:
            continue
        end = trained[peer_id]
        for a, b in profile.link.offline:
            if end <= a:
                what = "never came"
            elif end < b:
                what = "was cut short"
            else:
                continue
            lines.append(
                f"peer {peer_id}: offline window {a:g}-{b:g} s ({profile.name}) {what}: it "
                f"trained for {end:.1f} s; add steps or move the window"
            )
    return lines


def profiles_table(config: Config) -> Table:
    """Which peers emulate which device: link, slowdown, step time and offline windows per
    profile."""
    table = Table(title="device profiles")
    columns = ("profile", "peers", "up", "down", "latency", "loss", "slowdown", "step time")
    for name in (*columns, "offline"):
        table.add_column(name)
    for name, table_values in config.profiles.items():
        profile = parse_profile(name, table_values, config.peers)
        link = profile.link
        table.add_row(
            name,
            ",".join(map(str, profile.peers)),
            _rate(link.uplink_bps),
            _rate(link.downlink_bps),
            f"{link.latency_s * 1e3:g} ± {link.jitter_s * 1e3:g} ms" if link.latency_s else "-",
            f"{link.loss:.1%}" if link.loss else "-",
            f"{profile.slowdown:g}x" if profile.slowdown > 1 else "-",
            f"≥ {profile.step_time * 1e3:g} ms" if profile.step_time else "-",
            ", ".join(f"{a:g}-{b:g} s" for a, b in link.offline) or "-",
        )
    return table


def _rate(bps: float) -> str:
    return f"{bps / 1e6:g} Mbit/s" if bps else "-"


def sweep_table(entries: list[dict[str, Any]], title: str = "gossipdl sweep") -> Table:
    """One row per variant of a sweep: its settings, accuracy, bytes, start-up and training
    time."""
    table = Table(title=title)
    keys = list(entries[0]["settings"]) if entries else []
    for name in (*keys, "mean acc", "min acc", "finished", "sent", "start-up s", "training s"):
        table.add_column(name, justify="left" if name in keys else "right")
    for e in entries:
        settings = [str(e["settings"][k]) for k in keys]
        if "error" in e:
            table.add_row(*settings, f"[red]failed: {e['error']}[/]", "", "", "", "", "")
            continue
        table.add_row(
            *settings,
            "-" if e["mean_accuracy"] is None else f"{e['mean_accuracy']:.4f}",
            "-" if e["min_accuracy"] is None else f"{e['min_accuracy']:.4f}",
            str(e["peers_finished"]),
            human_bytes(e["total_bytes_sent"]),
            f"{e['startup_s']:.1f}",
            f"{e['training_s']:.1f}",
        )
    return table
