"""The README's code runs as printed: the Peer API example with real processes."""

from __future__ import annotations

import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import in_threads, run_script

ROOT = Path(__file__).resolve().parents[1]


def free_base_port(count: int) -> int:
    """A port p such that p .. p+count-1 were free a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            holders = []
            for i in range(count):
                h = socket.socket()
                h.bind(("127.0.0.1", base + i))
                holders.append(h)
            return base
        except OSError:
            continue
        finally:
            for h in holders:
                h.close()
    raise RuntimeError("no free port range")


def test_peer_api_example_trains_two_processes(tmp_path: Path) -> None:
    """Each rank runs the script as ``python examples/peer_api.py RANK WORLD PORT`` would, in
    a process of its own (forked from the preloaded server: no torch import each)."""
    world = 2  # the smallest ring: the example's code path is the same for any world size
    base = free_base_port(world)
    script = ROOT / "examples" / "peer_api.py"
    done: dict[int, subprocess.CompletedProcess[str]] = {}

    def run(rank: int) -> None:
        (tmp_path / str(rank)).mkdir()
        args = (str(rank), str(world), str(base))
        done[rank] = run_script(script, *args, cwd=tmp_path / str(rank), timeout=180)

    assert not in_threads(run, range(world))
    accuracies = []
    for rank in range(world):
        assert done[rank].returncode == 0, done[rank].stderr
        found = re.search(r"test accuracy ([0-9.]+)", done[rank].stdout)
        assert found, done[rank].stdout
        accuracies.append(float(found.group(1)))
    assert min(accuracies) > 0.85, accuracies


def test_readme_embeds_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "examples" / "peer_api.py").read_text().strip() in readme


def test_peer_api_example_divides_the_cores_among_its_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank's torch threads are the machine's cores over the world size, as ``gossipdl
    run`` sets them: with torch's default (every core) in every peer, 2 peers on 2 cores ran
    the example's MLP at ~100 ms a step instead of ~1 ms (OpenMP threads contending)."""
    import gossipdl.data

    class Stop(Exception):
        """Raised where the example loads its data: the threads are set by then."""

    seen: list[int] = []

    def load_dataset(name: str) -> None:
        seen.append(torch.get_num_threads())
        raise Stop

    threads = torch.get_num_threads()
    monkeypatch.setattr(gossipdl.data, "load_dataset", load_dataset)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(sys, "argv", ["peer_api.py", "0", "2", "5550"])
    torch.set_num_threads(3)  # neither the default nor the answer
    try:
        with pytest.raises(Stop):
            runpy.run_path(str(ROOT / "examples" / "peer_api.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    assert seen == [4]
