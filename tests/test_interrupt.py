"""A signal stops everything a launcher or a benchmark started: no orphan peers, no next
setting, one line and exit code 128 + the signal; and every process a launch starts is told
the run's start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    gossipdl_cmd,
    last_record,
    live_processes,
    peer_pids,
    small_config,
    wait_for,
    write_config,
)

from gossipdl.experiments.launcher import Placement, Swarm
from gossipdl.rundir import RUN_START_ENV, RunDir

ROOT = Path(__file__).resolve().parents[1]
# A stopped run's peers finish their step and report: seconds, not minutes. Past the
# launcher's own wait for its peers (_STOP_GRACE_S, 30 s), so that only a hang fails: on 2
# cores at load 10 one stop took 15 s.
STOP_S = 45


def blocks_sigint(pid: int) -> bool:
    """Whether process ``pid`` never sees SIGINT: its mask in /proc blocks it."""
    status = (Path("/proc") / str(pid) / "status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


# Execs its arguments with SIGINT at its default, as a terminal starts a command: a shell
# that runs tests in the background (`cmd &`, nohup) starts them with SIGINT ignored, which
# they pass on, and Python then never turns a Ctrl-C during its imports into an exception.
_AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def start(command: list[str], cwd: Path) -> subprocess.Popen[str]:
    """``command`` in a session of its own, whatever it leaves behind can be killed, with
    SIGINT at its default whoever started the tests."""
    return subprocess.Popen(
        [sys.executable, "-c", _AS_FROM_A_TERMINAL, *command], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True,
    )  # fmt: skip


def stopped(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """The exit code and stderr of ``proc``, which must end within ``STOP_S`` seconds."""
    try:
        _, stderr = proc.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"still running {STOP_S}s after the signal; stderr:\n{stderr}")
    return proc.returncode, stderr


def cleanup(proc: subprocess.Popen[str]) -> None:
    """Kill what a failed test left running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_ctrl_c_while_gossipdl_imports_is_one_line_and_code_130(tmp_path: Path) -> None:
    """A Ctrl-C in a launch's first second (its imports, and its fork server's) printed a
    KeyboardInterrupt traceback from each and exited -2: the signal killed it."""
    proc = start([sys.executable, "-m", "gossipdl", "run", "--peers", "2", "--steps", "1000000",
                  "--out", str(tmp_path / "run"), "--no-progress"], tmp_path)  # fmt: skip
    try:
        time.sleep(0.4)  # inside the imports: they take a second or more here
        os.killpg(proc.pid, signal.SIGINT)
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 130 and "Traceback" not in stderr, stderr
    assert "interrupted" in stderr.splitlines()[-1]


def test_sigterm_stops_a_benchmark_its_peers_and_its_next_setting(tmp_path: Path) -> None:
    out = tmp_path / "c"
    proc = start(
        [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--quick", "--peers", "2",
         "--steps", "1000000", "--only", "dense,choco-topk", "--topologies", "ring",
         "--engine", "real", "--out", str(out)], tmp_path,
    )  # fmt: skip
    first = out / "ring" / "dense"
    try:
        wait_for(lambda: all(last_record(first / "peers" / f"{i}.jsonl") for i in (0, 1)),
                 60, "the first setting's peers to train")  # fmt: skip
        proc.send_signal(signal.SIGTERM)  # to the script alone: it must stop its peers itself
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1].startswith("convergence.py: interrupted by SIGTERM")
    assert not peer_pids(first), "peer processes left running"
    assert (first / "summary.json").is_file()  # what was measured is kept
    assert not (out / "ring" / "choco-topk").exists(), "the next setting was started"


CTRL_C_OR_SIGTERM = pytest.mark.parametrize(
    "signum, group",
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c-to-the-group", "sigterm-to-the-process"],
)


def deliver(proc: subprocess.Popen[str], signum: int, group: bool) -> None:
    """``signum`` to ``proc``'s whole process group (what a terminal does on Ctrl-C), or to
    ``proc`` alone, which must then stop what it started itself."""
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)


def ranks_of(script: int) -> list[int]:
    """The worker processes a benchmark script started: forked by its fork server."""
    processes = live_processes()
    servers = {pid for pid, (parent, cmd) in processes.items()
               if parent == script and b"forkserver" in cmd}  # fmt: skip
    return [pid for pid, (parent, _) in processes.items() if parent in servers]


@CTRL_C_OR_SIGTERM
def test_a_signal_stops_a_benchmark_and_the_workers_it_spawned(
    signum: int, group: bool, tmp_path: Path
) -> None:
    proc = start(
        [sys.executable, str(ROOT / "benchmarks" / "allreduce.py"), "--procs", "2",
         "--sizes", "100k", "--repeats", "100000", "--warmup", "1"], tmp_path,
    )  # fmt: skip
    try:
        workers = wait_for(lambda: ranks_of(proc.pid), 60, "the ranks to start")
        assert all(blocks_sigint(p) for p in workers)  # born so: no traceback from each
        deliver(proc, signum, group)
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr
    name = signal.Signals(signum).name
    assert stderr.splitlines()[-1].startswith(f"allreduce.py: interrupted by {name}")
    wait_for(lambda: not set(workers) & live_processes().keys(), 5, "the ranks to exit")


@CTRL_C_OR_SIGTERM
def test_a_signal_stops_a_fault_search_its_workers_and_their_seeds(
    signum: int, group: bool, tmp_path: Path
) -> None:
    """The search stops its workers, removes the run directories of the seeds they were
    running (they broke nothing) and says how far it got. SIGTERM used to kill it at once:
    its workers died on a broken pipe, four tracebacks and leaked semaphores."""
    out = tmp_path / "search"
    proc = start(
        gossipdl_cmd("simulate", "--faults", "random", "--seeds", "0:2000", "--jobs", "2",
                     "--out", str(out)), tmp_path,
    )  # fmt: skip
    try:
        workers = wait_for(lambda: ranks_of(proc.pid), 60, "the search's workers to start")
        wait_for(lambda: list(out.glob("seed-*")), 60, "seeds to run")
        deliver(proc, signum, group)
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr and "leaked" not in stderr, stderr
    said = " ".join(stderr.split())
    assert "seeds 0:2000:" in said and "no invariant broken" in said, said
    assert not list(out.glob("seed-*")), "a running seed's directory kept"
    wait_for(lambda: not set(workers) & live_processes().keys(), 5, "the workers to exit")


def test_ctrl_c_stops_a_benchmarks_simulations_without_a_traceback(tmp_path: Path) -> None:
    """Pool workers running simulations stop in order (their summaries written) and exit
    quietly: the ``Interrupted`` a stopped simulation raises is not a worker's traceback."""
    proc = start(
        [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--quick", "--peers", "2",
         "--steps", "1000000", "--only", "dense,choco-topk", "--topologies", "ring",
         "--engine", "sim", "--jobs", "2", "--out", str(tmp_path / "c")], tmp_path,
    )  # fmt: skip
    try:
        workers = wait_for(lambda: ranks_of(proc.pid), 60, "the workers to start")
        wait_for(lambda: list((tmp_path / "c").glob("ring/*/peers/0.jsonl")), 60, "a run")
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1].startswith("convergence.py: interrupted by SIGINT")
    wait_for(lambda: not set(workers) & live_processes().keys(), 5, "the workers to exit")


def training_pair(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """``gossipdl run`` of two peers with a million steps to go, once both train; its run
    directory. The caller stops it (``cleanup`` if the test fails)."""
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=2, steps=1_000_000))
    out = tmp_path / "run"
    proc = start(gossipdl_cmd("run", str(config), "--out", str(out), "--no-progress"), tmp_path)
    try:
        wait_for(lambda: all(last_record(out / "peers" / f"{i}.jsonl") for i in (0, 1)),
                 60, "the peers to train")  # fmt: skip
    except BaseException:
        cleanup(proc)
        raise
    return proc, out


def test_sigint_to_gossipdl_run_stops_its_peers_and_exits_130(tmp_path: Path) -> None:
    proc, out = training_pair(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)  # to the launcher alone: it must stop its peers itself
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    assert not peer_pids(out), "peer processes left running"
    assert (out / "summary.json").is_file()


def test_peers_of_a_launcher_killed_with_sigkill_stop_in_order(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot stop its peers: they trained on to their last
    step (a million here). Each watches the launcher and stops as a SIGTERM stops it."""
    proc, out = training_pair(tmp_path)
    try:
        assert len(peer_pids(out)) == 2
        proc.kill()
        proc.wait()  # not its pipes: the fork server it started holds them while peers run
        wait_for(lambda: not peer_pids(out), STOP_S, "the peers to stop")
    finally:
        with contextlib.suppress(ProcessLookupError):  # what a failure left in its session
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    for rank in (0, 1):
        assert (out / "models" / f"{rank}.pt").is_file()  # each stopped in order: it saved
        assert (out / "peers" / f"{rank}.log").read_text().rstrip().endswith("interrupted")


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_a_launched_process_is_sent_sigterm_once_its_launcher_ends(pidfd: bool) -> None:
    """:func:`stop_with_launcher` in a process of its own, whose stand-in launcher ends."""
    script = f"""
import os, signal, subprocess, sys, time
from gossipdl.experiments import orphans
if not {pidfd}:
    del os.pidfd_open  # as on a platform without it
    orphans.ORPHAN_POLL_S = 0.05
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
assert not orphans.stop_with_launcher({{}}), "no launcher named: nothing to watch"
assert orphans.stop_with_launcher({{orphans.LAUNCHER_PID_ENV: str(launcher.pid)}})
time.sleep(0.5)
assert not got, "stopped while its launcher ran"
launcher.kill()
launcher.wait()  # as the launcher's shell reaps it
ended = time.monotonic()
while not got and time.monotonic() - ended < 5:
    time.sleep(0.01)
print("stopped" if got else "not stopped", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.stdout.strip() == "stopped", done.stderr


def test_ctrl_c_while_the_swarm_starts_stops_it_with_code_130_and_a_summary(
    tmp_path: Path,
) -> None:
    """A terminal's Ctrl-C reaches the launcher and its peers together: peer 0, stopped
    before it listened, made the launcher fail with code 2 and no summary, and a signal to
    the launcher alone waited for peer 0 and then started the others anyway."""
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=3, steps=10**6))
    out = tmp_path / "run"
    proc = start(gossipdl_cmd("run", str(config), "--out", str(out), "--no-progress"), tmp_path)
    try:
        wait_for(lambda: (out / "peers" / "0.log").exists(), 60, "peer 0 to be started")
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole group
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "did not start listening" not in stderr
    assert (out / "summary.json").is_file()
    assert not (out / "peers" / "2.log").exists()  # nobody started after the signal


def test_a_gossip_peer_dead_before_the_swarm_formed_stops_the_launch_at_once(
    tmp_path: Path,
) -> None:
    """A gossip swarm carries on without a dead peer, but before it formed the others wait
    for it: the launch waited out startup_timeout (129 s in a review) to say so."""
    (tmp_path / "slow.py").write_text(  # 1 s to load: the swarm forms after that
        "import time\nfrom gossipdl.data import load_dataset\n"
        "def data():\n    time.sleep(1)\n    return load_dataset('synthetic')\n"
    )
    config = small_config(tmp_path, peers=3, steps=10**6, startup_timeout=120.0,
                          dataset="slow:data")  # fmt: skip
    out = tmp_path / "run"
    command = gossipdl_cmd("run", str(write_config(tmp_path / "exp.toml", config)),
                           "--out", str(out), "--no-progress")  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})  # fmt: skip

    def peers() -> list[int]:  # the fork server's children, the launcher's its own
        live = live_processes()
        servers = {p for p, (parent, _) in live.items() if parent == proc.pid}
        return sorted(p for p, (parent, _) in live.items() if parent in servers)

    try:
        wait_for(lambda: len(peers()) == 3 and not list((out / "peers").glob("*.jsonl")), 60,
                 "three peers, not training yet")  # fmt: skip
        os.kill(peers()[-1], signal.SIGKILL)
        began = time.monotonic()
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 2 and "died before the swarm formed" in stderr, stderr
    assert time.monotonic() - began < STOP_S


def test_a_ring_whose_member_stops_a_step_first_still_evaluates_and_saves_every_peer(
    tmp_path: Path,
) -> None:
    """A Ctrl-C reaches a ring's peers a moment apart: one that stopped a step sooner left
    the others' all-reduce, and they failed without their final line and model (4 of 12
    Ctrl-Cs in a review). Here one peer hears it 0.3 s before the rest."""
    config = small_config(tmp_path, peers=3, steps=1_000_000, mode="ring")
    out = tmp_path / "run"
    proc = start(gossipdl_cmd("run", str(write_config(tmp_path / "ring.toml", config)),
                              "--out", str(out), "--no-progress"), tmp_path)  # fmt: skip
    try:
        wait_for(lambda: all(last_record(out / "peers" / f"{i}.jsonl") for i in range(3)),
                 120, "the peers to train")  # fmt: skip
        os.kill(peer_pids(out)[0], signal.SIGINT)  # as the launcher will, to peer 0 first
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        code, stderr = stopped(proc)
    finally:
        cleanup(proc)
    assert code == 130, stderr
    for i in range(3):
        assert last_record(out / "peers" / f"{i}.jsonl").get("final"), (i, stderr)
        assert (out / "models" / f"{i}.pt").is_file(), i


def test_every_process_a_swarm_starts_is_told_the_same_run_start(tmp_path: Path) -> None:
    config = small_config(tmp_path, peers=2, steps=1_000_000)
    run = RunDir(config.out).create()
    write_config(run.config, config)
    told = tmp_path / "told"  # each process the swarm starts appends what it was told
    record = f'echo "${RUN_START_ENV}" >> {told}; exec "$@"'
    before = time.time()
    swarm = Swarm(config, run, place=lambda rank: Placement(prefix=("sh", "-c", record, "sh")))
    after = time.time()
    try:
        swarm.start()
        wait_for(lambda: len(told.read_text().split()) == 2, 30, "both peers to start")
        swarm.kill(1)
        swarm.restart(1)
        wait_for(lambda: len(told.read_text().split()) == 3, 30, "the restarted peer to start")
    finally:
        swarm.stop(grace=5)
        swarm.close()
    values = told.read_text().split()
    assert len(set(values)) == 1
    assert before - 1e-6 <= float(values[0]) <= after + 1e-6  # written to the microsecond
