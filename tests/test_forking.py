"""Commands forked from the preloaded fork server behave as the subprocesses they replace:
their arguments, environment, directory, output, exit codes and signals."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import small_config, wait_for, write_config

from gossipdl.experiments import forking
from gossipdl.experiments.forking import ForkedCommand


def test_a_forked_command_gets_its_arguments_environment_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "COLUMNS": "50"}  # rich sizes the help to it
    help_ = ForkedCommand(["--help"], env, tmp_path / "help.log")
    assert help_.stdout is not None
    text = help_.stdout.read()
    assert help_.wait(60) == 0 and help_.poll() == 0
    assert "Commands" in text and max(len(line) for line in text.splitlines()) <= 50
    keys = ForkedCommand(["keys", "generate", "relative/alice"], {**os.environ}, tmp_path / "k.log")
    assert keys.wait(60) == 0
    assert (tmp_path / "relative" / "alice" / "peer.key").is_file()  # under the caller's cwd


def test_a_forked_commands_errors_go_to_its_log_and_its_code(tmp_path: Path) -> None:
    bad = ForkedCommand(["no-such-command"], {**os.environ}, tmp_path / "bad.log")
    assert bad.wait(60) == 2
    assert "No such command 'no-such-command'" in (tmp_path / "bad.log").read_text()
    # Reaped by the fork server before its exit code reached us: it looks alive, but its
    # process id is gone. Stopping a swarm signalled it and died of ProcessLookupError.
    bad.returncode = None
    bad.poll = lambda: None  # type: ignore[method-assign]
    bad.send_signal(0)  # signal 0 only asks: a reused process id is not disturbed


def test_a_forked_peer_stops_on_sigint_and_dies_on_kill(tmp_path: Path) -> None:
    """A founder waits an hour for the others: SIGINT ends it at once with 130 (its own
    handler, not the fork server's, which ignores SIGINT); SIGKILL reads as -9."""
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, startup_timeout=3600.0))
    args = ["peer", "--config", str(config), "--listen", "tcp://127.0.0.1:0"]
    founders = [
        ForkedCommand(
            [*args, "--out", str(tmp_path / name)], {**os.environ}, tmp_path / f"{name}.log"
        )
        for name in ("a", "b")
    ]
    try:
        for founder in founders:
            assert founder.stdout is not None and founder.stdout.readline().startswith(
                "listening on tcp://127.0.0.1:"
            )
        with pytest.raises(subprocess.TimeoutExpired):
            founders[0].wait(0.2)
        founders[0].send_signal(signal.SIGINT)
        founders[1].kill()
        codes = [founder.wait(60) for founder in founders]
    finally:
        for founder in founders:
            founder.kill()
    assert codes == [130, -signal.SIGKILL]
    assert "interrupted before training started" in (tmp_path / "a.log").read_text()


def test_a_forked_command_is_stopped_when_its_caller_exits(tmp_path: Path) -> None:
    """Not waited for (a crashed launcher would hang on its peers): SIGTERM, which a peer
    takes as a clean stop."""
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, startup_timeout=3600.0))
    log = tmp_path / "founder.log"
    args = ["peer", "--config", str(config), "--out", str(tmp_path / "f")]
    caller = (
        "import os, pathlib\n"
        "from gossipdl.experiments.forking import ForkedCommand\n"
        f"founder = ForkedCommand({args!r}, dict(os.environ), pathlib.Path({str(log)!r}))\n"
        "print(founder.stdout.readline(), end='', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("listening on "), done.stderr
    wait_for(lambda: "interrupted before training started" in log.read_text(), 60,
             "the founder to stop")  # fmt: skip


def _launch_in_a_pool_worker(out: str) -> int:
    from gossipdl.experiments.launcher import launch

    config = small_config(Path(out), peers=2, steps=10).replace(out=out)
    return int(launch(config, progress=False)["peers_finished"])


def test_a_launch_inside_a_daemonic_worker_starts_its_peers_as_subprocesses(
    tmp_path: Path,
) -> None:
    """A pool's workers are daemonic and may not fork children of their own: a launch
    there (a user's Pool, say) falls back to subprocesses."""
    with forking.context().Pool(1) as pool:
        assert pool.apply(_launch_in_a_pool_worker, (str(tmp_path / "run"),)) == 2


def _imported(names: list[str]) -> list[bool]:
    return [name in sys.modules for name in names]


def test_the_fork_server_has_imported_what_a_peer_would_import_when_it_starts() -> None:
    """typer's adapters (the first command line parsed) and the peer's modules come with the
    fork, not per peer; torch._dynamo (1.1–1.6 s) does not come at all: only torch.optim's
    steps import it, and peers step with gossipdl's SGD (test_local_optimizer)."""
    names = ["typer._adapters", "gossipdl.peers.runner", "torch._dynamo"]
    adapters = importlib.util.find_spec("typer._adapters") is not None  # not in older typers
    with forking.context().Pool(1) as pool:
        assert pool.apply(_imported, (names,)) == [adapters, True, False]


def test_only_a_launching_gossipdl_command_starts_the_fork_server_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[bool] = []
    monkeypatch.setattr(forking, "warm_up", lambda: started.append(True))
    for argv in (["/usr/bin/gossipdl", "peer"], ["-c"], ["pytest", "run"], ["/x/gossipdl"]):
        forking.warm_up_for(argv)
    assert not started
    for argv in (["/venv/bin/gossipdl", "run"], ["/src/gossipdl/__main__.py", "sweep"]):
        forking.warm_up_for(argv)
    assert started == [True, True]
