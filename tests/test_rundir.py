"""The run directory's files are written whole, even when several writers race, and read
whole while they are being written."""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import last_record, small_config

from gossipdl.experiments.simulated import simulate
from gossipdl.rundir import RunDir, write_json_atomic


def test_threads_rewriting_one_json_file_never_fail_or_leave_tmp_files(tmp_path: Path) -> None:
    """A peer's receive and watch threads both rewrite peers.json when the members change;
    with one tmp name per process, one thread's rename once took the other's tmp file
    away and the heartbeat thread died of FileNotFoundError."""
    path = tmp_path / "peers.json"
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def write(k: int) -> None:
        start.wait()
        try:
            for i in range(200):
                write_json_atomic(path, [{"id": k, "n": i}])
        except BaseException as exc:  # checked below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert json.loads(path.read_text())[0]["n"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_one_tmp_name_per_call_survives_a_write_interleaved_inside_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peers.json race, replayed deterministically: a second write runs to its end
    between the first one's tmp file and its rename (as another thread did). With one tmp
    name per process the first rename found its tmp file gone (FileNotFoundError)."""
    path = tmp_path / "peers.json"
    replace = os.replace
    nested = []

    def interleaved(src: str | Path, dst: str | Path) -> None:
        if not nested:
            nested.append(src)
            write_json_atomic(path, [{"id": 2}])  # the other thread, start to end
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interleaved)
    write_json_atomic(path, [{"id": 1}])
    assert nested and json.loads(path.read_text()) == [{"id": 1}]  # the later rename wins
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]


def test_a_live_metrics_file_cut_at_any_byte_reads_as_its_complete_lines(tmp_path: Path) -> None:
    """The torn JSONL read: a reader of a live run (a test helper, report, the progress
    display) saw a half-written last line and failed with JSONDecodeError. Every prefix of
    a real metrics file, a multi-byte character cut in two included, reads as the lines
    whose newline is written."""
    config = small_config(tmp_path, peers=2, steps=20, log_every=2)
    simulate(config, step_time=0.01)
    run = RunDir(config.out)
    whole = run.metrics(0).read_bytes() + '{"note": "café"}\n'.encode()
    lines = whole.splitlines(keepends=True)
    for cut in range(len(whole) - len(lines[-1]) - len(lines[-2]), len(whole) + 1):
        run.metrics(0).write_bytes(whole[:cut])
        complete = whole[:cut].count(b"\n")
        records = list(run.records(0))
        assert len(records) == complete, cut
        assert last_record(run.metrics(0)) == json.loads(lines[complete - 1]), cut


@pytest.mark.parametrize("chunk", [4, 1 << 16])  # the newline found in a later chunk, or the first
def test_a_resumed_peer_appends_after_its_last_complete_line_not_onto_a_cut_one(
    tmp_path: Path, chunk: int
) -> None:
    """A peer killed mid-write leaves half a line; its next life's first line used to join it
    and every reader skipped both (the resumed life's ``start`` line lost)."""
    from gossipdl.rundir import cut_to_last_line

    run = RunDir(tmp_path).create()
    path = run.metrics(2)
    lines = [json.dumps({"peer": 2, "step": s}) for s in (0, 10, 20)]
    path.write_text("\n".join(lines) + '\n{"peer": 2, "step": 3')
    cut_to_last_line(path, chunk)
    assert path.read_text() == "\n".join(lines) + "\n"
    cut_to_last_line(path, chunk)  # a file that ends with its newline stays as it is
    assert path.read_text() == "\n".join(lines) + "\n"
    path.write_text('{"peer": 2, "st')  # no complete line at all
    cut_to_last_line(path, chunk)
    assert path.read_bytes() == b""
    path.write_text(lines[0] + "\n" + '{"peer": 2, "st')
    with run.append_metrics(2) as f:
        f.write(json.dumps({"peer": 2, "step": 30, "start": True}) + "\n")
    assert [r["step"] for r in run.records(2)] == [0, 30]
    with run.append_metrics(3) as f:  # a first life: a new file
        f.write(lines[0] + "\n")
    assert [r["step"] for r in run.records(3)] == [0]


def _strict(text: str) -> object:
    """JSON as a strict reader takes it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_diverged_runs_summary_and_lines_are_strict_json(tmp_path: Path) -> None:
    """A run whose models blow up has NaN losses and consensus distance: they were written
    as bare NaN, which strict JSON readers refuse; they are null."""
    config = small_config(tmp_path, peers=3, steps=10, lr=3e38, log_every=5)
    simulate(config)
    run = RunDir(config.out)
    summary = _strict((run.root / "summary.json").read_text())
    assert isinstance(summary, dict) and summary["consensus_distance"] is None
    lines = [_strict(line) for line in run.metrics(0).read_text().splitlines()]
    assert any(isinstance(line, dict) and line["loss"] is None and line["step"] > 0
               for line in lines)  # fmt: skip


def test_a_line_that_is_no_metrics_object_is_skipped_by_every_reader(tmp_path: Path) -> None:
    """Not UTF-8, a JSON array, a bare number: the live display failed on the first two
    (UnicodeDecodeError, AttributeError), which stopped a launch and every peer in it, and
    the summary on the others; it reads what RunDir.records reads."""
    import io

    from rich.console import Console

    from gossipdl.experiments.display import LiveProgress
    from gossipdl.experiments.summary import summary_of

    run = RunDir(tmp_path / "run").create()
    good = [{"peer": 0, "step": 5, "bytes_sent": 1500}, {"peer": 0, "step": 7, "loss": 0.5}]
    strays = [b'{"x": "\xc3\x28"}', b'\xff\xfe{"a":1}', b"[1, 2]", b"42", b'"text"', b"null"]
    run.metrics(0).write_bytes(
        b"\n".join([json.dumps(good[0]).encode(), *strays, json.dumps(good[1]).encode()]) + b"\n"
    )
    live = LiveProgress(run, 10, console=Console(file=io.StringIO()))
    with live:
        live.refresh()
    (task,) = live.progress.tasks
    assert task.completed == 7 and task.fields["loss"] == "0.500"
    assert list(run.records(0)) == good
    assert summary_of(run)["peers"][0]["steps"] == 7


def _live(run: RunDir, **kwargs: Any) -> tuple[Any, io.StringIO]:
    """A LiveProgress over ``run`` that has read every line, and what it drew."""
    from rich.console import Console

    from gossipdl.experiments.display import LiveProgress

    drawn = io.StringIO()
    live = LiveProgress(run, 20, console=Console(file=drawn, width=150), **kwargs)
    live.__enter__()
    live.refresh()
    return live, drawn


def _write(run: RunDir, peer_id: int, *lines: dict[str, Any]) -> None:
    run.metrics(peer_id).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_live_display_counts_a_peers_lives_as_the_summary_does(tmp_path: Path) -> None:
    """A peer restarted without a checkpoint counts from 0 again ("resumed": false): the
    display showed its last life's bytes, the final table and summary.json every life's."""
    from gossipdl.experiments.display import human_bytes
    from gossipdl.experiments.summary import summary_of

    run = RunDir(tmp_path / "run").create()
    _write(
        run, 0,
        {"peer": 0, "step": 0, "bytes_sent": 0, "start": True},
        {"peer": 0, "step": 10, "bytes_sent": 5_000_000},
        {"peer": 0, "step": 10, "bytes_sent": 1000, "start": True, "resumed": False},
        {"peer": 0, "step": 20, "bytes_sent": 500_000, "final": True},
    )  # fmt: skip
    live, _ = _live(run)
    (task,) = live.progress.tasks
    live.__exit__()
    assert task.fields["sent"] == human_bytes(summary_of(run)["peers"][0]["bytes_sent"])
    assert task.fields["sent"] == "5.5 MB"


def test_the_live_display_says_which_peers_ended_died_or_are_away(tmp_path: Path) -> None:
    """A dead peer's clock ran on with no sign of its death, rows came in the order peers
    wrote their first lines, and a FedAvg worker showed "63/20" (its steps go by rounds)."""
    run = RunDir(tmp_path / "run").create()
    _write(run, 3, {"peer": 3, "step": 0, "start": True}, {"peer": 3, "step": 5})
    live, drawn = _live(run, targets={0: 63})  # peer 3's row first
    _write(run, 2, {"peer": 2, "step": 0, "start": True}, {"peer": 2, "step": 8, "online": False})
    _write(run, 1, {"peer": 1, "step": 20, "final": True, "stopped_early": True})
    _write(run, 0, {"peer": 0, "step": 63, "final": True})
    live.refresh()
    live.dead([1, 3])  # the launcher saw their processes fail
    tasks = {task.fields["peer"]: task for task in live.progress.tasks}
    status = {i: task.fields["status"] for i, task in tasks.items()}
    assert status == {0: "[green]finished", 1: "[yellow]stopped", 2: "[yellow]offline",
                      3: "[red]dead"}  # fmt: skip
    assert all(tasks[i].stop_time is not None for i in (0, 1, 3)) and tasks[2].stop_time is None
    live.progress.console.print(*live.progress.get_renderables())
    frame = drawn.getvalue()
    assert frame.index("peer   0") < frame.index("peer   1") < frame.index("peer   2")
    assert frame.index("peer   2") < frame.index("peer   3")
    assert "63/63" in frame and "finished" in frame and "dead" in frame
    with run.metrics(3).open("a") as f:  # restarted: its new life's first line
        f.write(json.dumps({"peer": 3, "step": 5, "start": True, "resumed": True}) + "\n")
    live.refresh()
    live.__exit__()
    assert tasks[3].fields["status"] == "" and tasks[3].stop_time is None


def test_only_a_files_canonical_id_name_is_a_peer_or_shard_of_the_run(tmp_path: Path) -> None:
    """``peers/03.jsonl`` was read as peer 3, whose path is ``peers/3.jsonl``: reading it
    failed with FileNotFoundError. Such names are skipped, as a name that is no number is."""
    from gossipdl.experiments.summary import summary_of

    run = RunDir(tmp_path / "run").create()
    (tmp_path / "run" / "servers").mkdir()
    line = json.dumps({"step": 1, "time": 0.1}) + "\n"
    for name in ("0", "12", "03", "00", "+4", "٣", "abc"):
        (tmp_path / "run" / "peers" / f"{name}.jsonl").write_text(line)
        (tmp_path / "run" / "servers" / f"{name}.json").write_text('{"bytes_sent": 1}')
    assert run.peer_ids() == run.server_shards() == [0, 12]
    summary = summary_of(run)
    assert [p["id"] for p in summary["peers"]] == [0, 12] and summary["server_bytes_sent"] == 2
