"""The README's code runs as printed: the Peer API example with real processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

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


def test_peer_api_example_trains_two_processes() -> None:
    world = 2  # the smallest ring: the example's code path is the same for any world size
    base = free_base_port(world)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "examples" / "peer_api.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(world), str(base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    accuracies = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        found = re.search(r"test accuracy ([0-9.]+)", out)
        assert found, out
        accuracies.append(float(found.group(1)))
    assert min(accuracies) > 0.85, accuracies


def test_readme_embeds_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "examples" / "peer_api.py").read_text().strip() in readme
