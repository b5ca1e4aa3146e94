"""The run directory's files are written whole, even when several writers race."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from gossipdl.rundir import write_json_atomic


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
