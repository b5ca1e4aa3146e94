"""What a person sees: a live per-peer progress display, the device profiles, and the final
results tables of a run and of a sweep."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from gossipdl.conditions import parse_profile, parse_profiles
from gossipdl.config import Config
from gossipdl.experiments.summary import Lives
from gossipdl.rundir import RunDir, counter, number, parse_records


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB' (decimal units, as network rates are quoted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


class _ById(Progress):
    """Rows in peer id order, whichever peer wrote its first line first."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(sorted(self.tasks, key=lambda task: task.fields["peer"]))


def _status(record: dict[str, Any]) -> str:
    """What a peer's latest line says of it: its last (finished, or stopped early), away
    inside an offline window, or training ("")."""
    if record.get("final"):
        return "[yellow]stopped" if record.get("stopped_early") else "[green]finished"
    return "[yellow]offline" if record.get("online") is False else ""


class LiveProgress:
    """Tails ``peers/<id>.jsonl`` and shows each peer's step, loss, bytes sent (over its
    lives, as ``summary.json`` counts them) and status; ``targets``: a peer's last step
    where it is not ``steps`` (:func:`~gossipdl.training.last_steps`)."""

    def __init__(
        self,
        run: RunDir,
        steps: int,
        console: Console | None = None,
        enabled: bool = True,
        targets: Mapping[int, int] | None = None,
    ) -> None:
        self._run = run
        self._enabled = enabled
        self._steps = steps
        self._targets = dict(targets or {})
        self._offsets: dict[int, int] = {}
        self._tasks: dict[int, TaskID] = {}
        self._lives: dict[int, Lives] = {}
        self.progress = _ById(
            TextColumn("[bold]peer {task.fields[peer]:>3}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("sent {task.fields[sent]}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
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

    def dead(self, peer_ids: Iterable[int]) -> None:
        """Mark peers whose process failed (the launcher sees it) dead, their clocks stopped,
        unless their last line was their final one; a new life's first line clears it."""
        if not self._enabled:
            return
        for peer_id in peer_ids:
            task = self._task(peer_id)
            if not self._ended(task):
                self.progress.update(task, status="[red]dead")
                self.progress.stop_task(task)

    def _task(self, peer_id: int) -> TaskID:
        """The peer's row, added on first sight."""
        if peer_id not in self._tasks:
            self._tasks[peer_id] = self.progress.add_task(
                "", total=self._targets.get(peer_id, self._steps), peer=peer_id, loss="-",
                acc="-", sent="-", status="",
            )  # fmt: skip
        return self._tasks[peer_id]

    def _ended(self, task: TaskID) -> Task | None:
        """The row, if its clock is stopped (its final line came, or it died)."""
        row = next(row for row in self.progress.tasks if row.id == task)
        return row if row.stop_time is not None else None

    def _update(self, peer_id: int, record: dict[str, Any]) -> None:
        task = self._task(peer_id)
        record = self._lives.setdefault(peer_id, Lives()).add(record)
        if record.get("start") and (row := self._ended(task)):  # a new life: the clock runs on
            row.stop_time = None
        fields: dict[str, Any] = {
            "sent": human_bytes(counter(record, "bytes_sent")),
            "status": _status(record),
        }
        for key, field in (("loss", "loss"), ("accuracy", "acc")):
            if (value := number(record, key)) is not None:
                fields[field] = f"{value:.3f}"
        self.progress.update(task, completed=counter(record, "step"), **fields)
        if record.get("final"):
            self.progress.stop_task(task)


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
