"""One CLI: --version, help that reads at 80 columns, the same overrides (flags and --set) on
every command that builds a config, config mistakes named with a fix, provenance in
config.toml, and Ctrl-C ending with exit code 130."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch
import typer
import zmq
from conftest import (
    fork_gossipdl,
    last_record,
    restore_logging,
    small_config,
    start_peer,
    wait_for,
    write_config,
)
from typer.testing import CliRunner

import gossipdl.cli as cli
from gossipdl.conditions import parse_slowdown
from gossipdl.config import (
    FIELDS,
    TABLE_KEYS,
    Config,
    ConfigError,
    from_dict,
    load_config,
    parse_setting,
    parse_value,
    resolved,
    to_dict,
)
from gossipdl.experiments import launcher
from gossipdl.peers import bootstrap
from gossipdl.peers.runner import prepare_run_dir
from gossipdl.rundir import RunDir
from gossipdl.transport.addresses import interface_ips

PANELS = ("Swarm", "Data and model", "Optimisation", "Communication", "Faults and links", "Output")


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI sets up logging for the process; give the next tests theirs back."""
    restore_logging(monkeypatch)


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the CLI in-process: exit code, stdout, and stderr with rich's wrapping undone."""
    result = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "80", **(env or {})})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, " ".join(result.stderr.split())


def fails(*args: str) -> str:
    """What a command that must fail with exit code 2 printed (its ``error:`` line last)."""
    code, _, stderr = invoke(*args)
    assert code == 2 and "error:" in stderr, stderr
    return stderr


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """The configs ``run``/``experiment``/``sweep`` hand the launcher; no peer starts."""
    seen: list[Config] = []

    def launch(config: Config, **kwargs: Any) -> dict[str, Any]:
        seen.append(config)
        raise launcher.LaunchError("stopped by the test before any peer started")

    monkeypatch.setattr(launcher, "launch", launch)
    return seen


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """The configs ``peer``/``join`` hand ``_train``; no peer starts."""
    seen: list[Config] = []

    def train(config: Config, **kwargs: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(cli, "_train", train)
    return seen


def commands() -> Iterator[tuple[str, ...]]:
    """Every command path of the app, groups included: (), ("run",), ("keys", "generate")."""

    def walk(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        yield path
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, (*path, name))

    yield from walk(typer.main.get_command(cli.app), ())


def boxes(help_text: str) -> dict[str, str]:
    """A rich help screen's panels: title -> the text inside."""
    found: dict[str, str] = {}
    for chunk in help_text.split("╭─ ")[1:]:
        title, _, body = chunk.partition("\n")
        found[title.split(" ─")[0].strip()] = body.split("╰")[0]
    return found


# -- --version and help ------------------------------------------------------------------


def test_version_prints_the_package_version() -> None:
    code, stdout, _ = invoke("--version")
    assert code == 0
    assert stdout.strip() == version("gossipdl")


def test_every_help_screen_is_complete_at_80_columns_without_bool_metavars() -> None:
    paths = list(commands())
    assert ("run",) in paths and ("keys", "generate") in paths
    for path in paths:
        result = CliRunner().invoke(cli.app, [*path, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, (path, result.output)
        text = result.stdout
        assert max(len(line) for line in text.splitlines()) <= 80, path
        assert "…" not in text, f"{path}: a help text is cut"
        assert "<bool>" not in text, f"{path}: a flag shows a <bool> type"
    peer = CliRunner().invoke(cli.app, ["peer", "--help"], env={"COLUMNS": "80"}).stdout
    assert "[default: tcp://127.0.0.1:0]" in " ".join(peer.split())  # not eaten as markup


def test_every_default_an_option_help_names_is_shown_not_eaten_as_markup() -> None:
    """rich reads an unescaped ``[default: …]`` in a help text as markup and drops it: report
    --out and data fetch --data-dir lost theirs."""
    root = typer.main.get_command(cli.app)
    for path in commands():
        command = root
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        shown = " ".join(
            CliRunner().invoke(cli.app, [*path, "--help"], env={"COLUMNS": "200"}).stdout.split()
        )
        for param in command.params:
            helped = " ".join((getattr(param, "help", None) or "").split())
            if "[default:" in helped:
                default = helped.split("[default:")[1].split("]")[0]
                assert f"[default:{default}]" in shown.replace("\\", ""), (path, param.name)


def test_run_help_puts_every_option_in_one_of_six_panels() -> None:
    text = CliRunner().invoke(cli.app, ["run", "--help"], env={"COLUMNS": "80"}).stdout
    panels = boxes(text)
    assert [p for p in panels if p in PANELS] == list(PANELS)
    options = boxes(text)["Options"]
    assert options.count("--") == 1 and "--help" in options  # nothing else left unpanelled
    flags = " ".join(panels[p] for p in PANELS)
    for name in FIELDS:
        if name not in TABLE_KEYS:
            assert f"--{name.replace('_', '-')} " in flags, name
    assert "--set" in panels["Swarm"] and "--progress" in panels["Output"]


# -- the same overrides on every command ---------------------------------------------------


def test_set_reads_values_as_toml_else_as_text() -> None:
    assert parse_setting("steps=300") == ("steps", 300)
    assert parse_setting("lr = 1e-3") == ("lr", 0.001)
    assert parse_setting("codec=topk:0.01") == ("codec", "topk:0.01")
    assert parse_setting("hidden=1024,512") == ("hidden", "1024,512")
    assert parse_setting("hidden=[64, 32]") == ("hidden", [64, 32])
    assert parse_setting('codec="fp16"') == ("codec", "fp16")
    assert parse_value("out", "2024") == "2024"  # a string key takes the text as written
    assert parse_value("slowdown", "") == ""
    assert parse_setting('profiles={phone={peers="0-1", up="1mbit"}}') == (
        "profiles",
        {"phone": {"peers": "0-1", "up": "1mbit"}},
    )
    config = from_dict(dict(parse_setting(s) for s in ("hidden=1024,512", "steps=3")))
    assert (config.hidden, config.steps) == ((1024, 512), 3)
    for bad in ("steps", "=3", ""):
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_setting(bad)


def test_run_takes_set_for_any_key_after_the_file(tmp_path: Path, launched: list[Config]) -> None:
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path, steps=60))
    fails("run", str(path), "--steps", "5", "--set", "codec=fp16", "--set", "hidden=8,4",
          "--set", "model=mlp", "--set", "lr=0.5")  # fmt: skip
    assert (launched[0].steps, launched[0].codec, launched[0].hidden) == (5, "fp16", (8, 4))
    assert (launched[0].model, launched[0].lr, launched[0].dataset) == ("mlp", 0.5, "synthetic")
    assert "steps is already set" in fails("run", "--steps", "3", "--set", "steps=4")


def test_experiment_takes_run_flags_and_set(tmp_path: Path, launched: list[Config]) -> None:
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path, steps=60))
    out = tmp_path / "short"
    fails("experiment", str(path), "--steps", "3", "--set", "codec=topk:0.1", "--peers", "2",
          "--out", str(out), "--no-progress")  # fmt: skip
    config = launched[0]
    assert (config.steps, config.codec, config.peers, config.out) == (3, "topk:0.1", 2, str(out))
    assert config.dataset == "synthetic"  # the rest still comes from the file
    assert "names peer 5" in fails("experiment", str(path), "--slowdown", "5:2")


def test_sweep_takes_run_flags_and_set_for_every_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gossipdl.experiments import sweep

    planned: list[tuple[Config, dict[str, list[Any]]]] = []

    def run_sweep(base: Config, axes: dict[str, list[Any]], root: Path, one: Any) -> list[Any]:
        planned.append((base, axes))
        return []

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)
    monkeypatch.setattr(cli, "_report", lambda directories, out: None)
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path, steps=60))
    code, _, stderr = invoke("sweep", str(path), "--grid", "lr=0.1,0.05", "--steps", "3",
                             "--set", "codec=fp16", "--out", str(tmp_path / "sw"))  # fmt: skip
    assert code == 0, stderr
    base, axes = planned[0]
    assert (base.steps, base.codec, base.out) == (3, "fp16", str(tmp_path / "sw"))
    assert axes == {"lr": [0.1, 0.05]}  # grid values read as --set reads them: numbers
    assert "did you mean 'steps'" in fails("sweep", str(path), "--grid", "lr=0.1",
                                            "--set", "stpes=3")  # fmt: skip


def test_a_failed_sweep_variant_lists_its_error_in_sweep_json(
    tmp_path: Path, launched: list[Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """sweep.json said only "the run into ... failed (see above)"; it keeps the message."""
    monkeypatch.setattr(cli, "_report", lambda directories, out: None)
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path))
    code, _, stderr = invoke("sweep", str(path), "--grid", "lr=0.1,0.05",
                             "--out", str(tmp_path / "sw"))  # fmt: skip
    assert code == 1 and len(launched) == 2, stderr
    variants = json.loads((tmp_path / "sw" / "sweep.json").read_text())["variants"]
    assert [v["error"] for v in variants] == ["stopped by the test before any peer started"] * 2


def test_peer_and_join_take_run_flags_set_and_advertise(
    tmp_path: Path, trained: list[Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path, steps=60))
    env = {"GOSSIPDL_ADVERTISE": "tcp://10.0.0.7:5555"}
    code, _, stderr = invoke("peer", "--config", str(path), "--steps", "7", "--set",
                             "codec=fp16", env=env)  # fmt: skip
    assert code == 0, stderr
    assert (trained[0].steps, trained[0].codec) == (7, "fp16")
    assert trained[0].advertise == "tcp://10.0.0.7:5555"  # from the environment
    invoke("peer", "--config", str(path), "--advertise", "tcp://10.0.0.8:1", env=env)
    assert trained[1].advertise == "tcp://10.0.0.8:1"  # the flag wins

    from gossipdl.peers import bootstrap

    swarm = to_dict(small_config(tmp_path, steps=60, codec="fp16"))
    monkeypatch.setattr(bootstrap, "fetch_swarm_info", lambda *a, **k: {"config": swarm})
    code, _, stderr = invoke("join", "tcp://10.0.0.5:5555", "--steps", "9", "--set",
                             "lr=0.5", env=env)  # fmt: skip
    assert code == 0, stderr
    joined = trained[2]
    assert (joined.steps, joined.lr, joined.codec) == (9, 0.5, "fp16")  # local keys win
    assert joined.advertise == "tcp://10.0.0.7:5555"
    invoke("join", "tcp://10.0.0.5:5555", "--advertise", "tcp://10.0.0.9:2", env=env)
    assert trained[3].advertise == "tcp://10.0.0.9:2"


# -- config mistakes -----------------------------------------------------------------------


def test_a_typod_key_suggests_the_nearest_known_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'stpes'; did you mean 'steps'\?"):
        from_dict({"stpes": 3})
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        from_dict({"batch-size": 3})
    with pytest.raises(ConfigError, match=r"known keys: .*steps"):
        from_dict({"colour": "red"})
    path = tmp_path / "typo.toml"
    path.write_text("peers = 4\neval_evry = 10\n")
    message = fails("run", str(path))
    expected = f"unknown config key 'eval_evry' in {path}; did you mean 'eval_every'?"
    assert "".join(expected.split()) in "".join(message.split())  # a long path may wrap
    assert "did you mean 'steps'" in fails("run", "--set", "stpes=3")
    path.write_text('peers = 2\n[profiles.phone]\npeers = "0"\nuup = "1mbit"\n')
    assert "profile 'phone': unknown key 'uup'; did you mean 'up'?" in fails("run", str(path))


def test_a_string_where_a_number_belongs_is_an_error(tmp_path: Path) -> None:
    for key, value in (("steps", "300"), ("lr", "0.1"), ("peers", "x")):
        with pytest.raises(ConfigError, match=f"{key} = '{value}' is a string"):
            from_dict({key: value})
    path = tmp_path / "quoted.toml"
    path.write_text('steps = "300"\n')
    assert "steps = '300' is a string" in fails("run", str(path))
    with pytest.raises(ConfigError, match="hidden"):
        from_dict({"hidden": ["64"]})
    assert load_config(None, steps=300, lr=1).lr == 1.0  # numbers stay fine


def test_a_config_built_directly_checks_types_as_a_file_does() -> None:
    """``Config(...)`` checked ranges only: ``lr='0.1'`` failed on a bare ``'>' not
    supported``, ``steps=None`` likewise and ``steps=5.5`` was taken. Each value now goes
    through the check a file's does, with the same message."""
    for values in ({"lr": "0.1"}, {"peers": "4"}, {"steps": None}, {"steps": 5.5},
                   {"hidden": ["64"]}, {"overlap": 1}, {"out": 3}):  # fmt: skip
        with pytest.raises(ConfigError) as direct:
            Config(**values)
        if None not in values.values():  # from_dict reads None as "the default"
            with pytest.raises(ConfigError) as read:
                from_dict(values)
            assert str(direct.value) == str(read.value)
        assert str(direct.value).startswith(f"{next(iter(values))} = ")
    config = Config(steps=5.0, lr=1, hidden=[64, 32])  # coerced as a file's values are
    assert (config.steps, config.lr, config.hidden) == (5, 1.0, (64, 32))
    assert type(config.steps) is int and type(config.lr) is float
    assert Config(hidden="64,32").hidden == (64, 32) == load_config(None, hidden="64,32").hidden
    import numpy as np  # what Python callers pass, taken as before the check: paths, arrays

    assert Config(out=Path("/tmp/x"), data_dir=Path("d")).out == "/tmp/x"
    from_numpy = Config(hidden=(np.int64(16), 8)).hidden
    assert Config(hidden=np.array([16, 8])).hidden == (16, 8) == from_numpy


def test_per_peer_options_are_checked_against_the_peer_count(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"slowdown '9:4' names peer 9.*peers 0\.\.3"):
        Config(peers=4, slowdown="9:4")
    with pytest.raises(ConfigError, match="names peer 4"):
        Config(peers=4, slowdown="0:2,4:2")
    assert Config(peers=4, slowdown="3:4").slowdown == "3:4"
    assert parse_slowdown("9:4") == {9: 4.0}  # a peer on its own knows no swarm size
    with pytest.raises(ConfigError, match=r"profile 'phone': peers = '2-4' names peer 4"):
        Config(peers=4, profiles={"phone": {"peers": "2-4"}})
    assert "names peer 9" in fails("run", "--slowdown", "9:4")
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=3))
    assert "peers 0..1" in fails("peer", "--config", str(path), "--peers", "2", "--slowdown",
                                 "2:2")  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555", "tcp://10.0.0.5:0",
     "tcp://10.0.0.5:65536", "10.0.0.5:5555", "tcp://10.0.0.5"],
)  # fmt: skip
def test_advertise_must_be_a_concrete_tcp_address(bad: str) -> None:
    with pytest.raises(ConfigError, match=f"advertise = {re.escape(repr(bad))}.*tcp://HOST:PORT"):
        Config(advertise=bad)
    assert "advertise =" in fails("run", "--advertise", bad)


def test_good_advertise_and_metrics_hook_values_pass() -> None:
    for good in ("tcp://10.0.0.5:5555", "tcp://node7.cluster:1", "tcp://[fe80::1]:65535", ""):
        assert Config(advertise=good).advertise == good
    assert Config(metrics_hook="my_pkg.hooks:make_sink").metrics_hook == "my_pkg.hooks:make_sink"
    for bad in ("nope", "pkg:", ":f", "pkg:f:g"):
        with pytest.raises(ConfigError, match=r"metrics_hook = .*module:function"):
            Config(metrics_hook=bad)


# -- provenance ----------------------------------------------------------------------------


def test_resolved_names_the_algorithm_that_runs_and_keeps_an_automatic_gamma() -> None:
    lossy = resolved(Config(codec="topk:0.01"))
    assert (lossy.algorithm, lossy.gamma) == ("choco", 0.0)  # chosen per model at the start
    assert (resolved(Config()).algorithm, resolved(Config()).gamma) == ("dense", 0.0)
    assert resolved(Config(codec="topk:0.01", gamma=0.2)).gamma == 0.2  # given: kept
    assert resolved(Config(mode="ring")).algorithm == "auto"  # the ring mode averages no models
    assert resolved(lossy) == lossy


def test_run_launches_and_announces_the_resolved_config(
    tmp_path: Path, launched: list[Config]
) -> None:
    message = fails("run", "--codec", "topk:0.01", "--out", str(tmp_path / "r"))
    assert "choco (γ auto), codec topk:0.01" in message  # the banner
    assert (launched[0].algorithm, launched[0].gamma) == ("choco", 0.0)  # its config.toml


# -- Ctrl-C --------------------------------------------------------------------------------


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_of_a_founding_peer_waiting_for_others_exits_at_once(
    tmp_path: Path, signum: int, exit_code: int
) -> None:
    """128 + the signal, as shells report it (SIGTERM exited 130 as SIGINT does)."""
    # it would wait an hour for the others: ending within the minute is ending at once
    config = small_config(tmp_path, peers=3, startup_timeout=3600.0)
    config_file = write_config(tmp_path / "exp.toml", config)
    out = tmp_path / "p"
    proc, _ = start_peer("--config", str(config_file), "--out", str(out),
                         "--set", "codec=topk:0.01", log=tmp_path / "p.log")  # fmt: skip
    proc.send_signal(signum)
    try:
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    log = (tmp_path / "p.log").read_text()
    assert code == exit_code, (code, log)
    assert "interrupted before training started" in log and "Traceback" not in log
    assert "gossip: ring, choco (γ auto), codec topk:0.01" in log  # the banner's line
    recorded = tomllib.loads((out / "config.toml").read_text())
    assert (recorded["algorithm"], recorded["gamma"], recorded["codec"]) == (
        "choco",
        0.0,
        "topk:0.01",
    )


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_training_stops_a_peer_or_server_in_order_then_exits_with_its_code(
    tmp_path: Path, signum: int, exit_code: int
) -> None:
    """`peer` (and `join`, the same code) and `server` stopped in order on a signal, then
    exited 0, where the README promises 130 or 143 as `run` gives (a review)."""
    config = small_config(tmp_path, mode="single", steps=1_000_000)
    out = tmp_path / "p"
    peer, _ = start_peer("--config", str(write_config(tmp_path / "p.toml", config)),
                         "--out", str(out), log=tmp_path / "p.log")  # fmt: skip
    ps = small_config(tmp_path, mode="ps", peers=2)
    server = fork_gossipdl("server", "--config", str(write_config(tmp_path / "ps.toml", ps)),
                           "--out", str(tmp_path / "s"), log=tmp_path / "s.log")  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().startswith("listening on")
        wait_for(lambda: (last_record(out / "peers" / "0.jsonl") or {}).get("step"), 60,
                 "the peer to train")  # fmt: skip
        for proc in (peer, server):
            proc.send_signal(signum)
        codes = [peer.wait(60), server.wait(60)]
    finally:
        for proc in (peer, server):
            if proc.poll() is None:
                proc.kill()
    logs = [(tmp_path / f"{name}.log").read_text() for name in ("p", "s")]
    assert codes == [exit_code, exit_code], logs
    for log in logs:
        assert log.rstrip().endswith("interrupted") and "Traceback" not in log
    final = last_record(out / "peers" / "0.jsonl")
    assert final is not None and final["final"] and final["stopped_early"]
    assert (out / "summary.json").is_file() and (tmp_path / "s" / "servers" / "0.json").is_file()


def test_ctrl_c_in_run_or_sweep_exits_with_the_signal_code_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Config] = []

    def launch(config: Config, **kwargs: Any) -> dict[str, Any]:
        calls.append(config)
        raise launcher.Interrupted(signal.SIGINT if len(calls) == 1 else signal.SIGTERM)

    monkeypatch.setattr(launcher, "launch", launch)
    code, _, stderr = invoke("run", "--out", str(tmp_path / "r"))
    assert (code, stderr.split()[-1]) == (130, "interrupted")
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path))
    code, _, stderr = invoke("sweep", str(path), "--grid", "lr=0.1,0.05", "--out",
                             str(tmp_path / "sw"))  # fmt: skip
    assert code == 128 + signal.SIGTERM and stderr.endswith("interrupted")
    assert len(calls) == 2, "the sweep went on to its next variant"


def test_an_out_that_is_a_file_is_refused_by_run_simulate_sweep_and_report(
    tmp_path: Path,
) -> None:
    """Each crashed with a traceback (FileExistsError, NotADirectoryError)."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    path = write_config(tmp_path / "exp.toml", small_config(tmp_path))
    for args, says in [
        (["simulate", str(path)], "out = '" + str(afile) + "' is a file"),
        (["run", str(path)], "out = '" + str(afile) + "' is a file"),
        (["sweep", str(path), "--grid", "lr=0.1,0.05"], f"--out {afile} is a file"),
        (["report", str(tmp_path / "r")], f"{afile} is a file"),
    ]:
        if args[0] == "report":
            assert invoke("simulate", str(path), "--out", str(tmp_path / "r"))[0] == 0
        assert says in fails(*args, "--out", str(afile)), args
    below = afile / "x"  # run and simulate crashed with NotADirectoryError
    for command in ("simulate", "run"):
        assert "': cannot create it (" in fails(command, str(path), "--out", str(below))
    assert afile.read_text() == "mine"


def test_report_takes_several_directories_and_an_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gossipdl.experiments import report

    asked: list[tuple[list[Path], Path | None]] = []
    monkeypatch.setattr(
        report, "write_report", lambda dirs, out: asked.append((dirs, out)) or [Path("x.md")]
    )
    code, _, stderr = invoke("report", "a", "b", "c", "--out", "cmp")
    assert code == 0, stderr
    assert asked == [([Path("a"), Path("b"), Path("c")], Path("cmp"))]
    invoke("report", "a")
    assert asked[1] == ([Path("a")], None)


HUGE_PAGE_PROBE = """
import os, re, sys
import gossipdl.cli  # sets the default before torch comes in
import torch
t = torch.ones(20 * 2**20)  # 80 MB, touched
smaps = open("/proc/self/smaps").read()
huge = sum(int(k) for k in re.findall(r"AnonHugePages:\\s+(\\d+) kB", smaps))
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), huge)
"""


@pytest.mark.parametrize("given", [None, "0"])
def test_commands_turn_on_torchs_huge_pages_unless_told_not_to(given: str | None) -> None:
    """gossipdl's commands export THP_MEM_ALLOC_ENABLE=1 before torch allocates, unless the
    user set it; where the kernel offers huge pages on request, a large tensor then sits in
    them (and with 0, in none)."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    done = subprocess.run(
        [sys.executable, "-c", HUGE_PAGE_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    value, huge_kb = done.stdout.split()
    assert value == (given or "1")
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    offered = mode.is_file() and "[never]" not in mode.read_text()
    if given == "0" and "[always]" not in (mode.read_text() if mode.is_file() else ""):
        assert int(huge_kb) == 0
    if given is None and offered:
        assert int(huge_kb) >= 40 * 1024  # most of the 80 MB tensor is in 2 MB pages


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "lr=inf"], "lr = inf is not a valid float"),
        (["--lr", "1e200"], "lr = 1e+200; above float32's largest value"),  # crashed mid-run
        (["--set", "max_message_mb=inf"], "max_message_mb = inf is not a valid float"),
        (["--set", "seed=-1"], "seed = -1; use 0 <= seed < 2**32"),
        (["--set", "seed=99999999999999999999"], "seed = 99999999999999999999; use 0 <="),
        (["--set", 'host=""'], 'host = ""; give the address launched peers listen on'),
        (["--model", "cnn2d"], "model = 'cnn2d': model 'cnn2d' needs input_shape"),
        pytest.param(["--device", "cuda"], "device = 'cuda': device 'cuda'", marks=NO_GPU),
        (["--samples-per-peer", "99999999"], "samples_per_peer = 99999999; mnist1d generates"),
        (["--csv", "sink"], "csv: these feed a real peer's metrics lines"),
        (["--dataset", "synthetic-fedprox:-1:1"], "dataset = 'synthetic-fedprox:-1:1'"),
        (["--trigger", "periodic:²"], "'²' is not a whole number"),
        (["--drift", "²:permute"], "drift '²:permute': use STEP:permute"),
        (["--drift", "5:permute"], "step 5 comes after the run's last step (steps = 5)"),
        (["--drift", "2:permute:0.2"], "a fraction 0.2 of 2 peers is none of them"),
        (["--set", 'profiles={p={peers="0", slowdown=inf}}'], "slowdown = inf; use a number >= 1"),
    ],
)
def test_hostile_but_plausible_values_are_one_clear_error_before_anything_runs(
    args: list[str], says: str, tmp_path: Path
) -> None:
    """A review's probes: each was a traceback, a run that crashed or hung after starting
    (``inf`` cannot even be written back into config.toml), an error naming another key,
    a silently ignored flag, or rich turning ``:-1:`` into an emoji."""
    out = tmp_path / "run"
    said = fails("simulate", "--peers", "2", "--steps", "5", "--no-progress", "--out", str(out),
                 *args)  # fmt: skip
    assert says in said, said
    assert not out.exists()  # refused before the run directory


BY_HAND = ["--peers", "2", "--steps", "5", "--dataset", "synthetic", "--model", "logistic",
           "--startup-timeout", "3"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--dataset", "cifar10", "--data-dir", "nodata"], "dataset = 'cifar10': cifar10: nodata"),
        (["--dataset", "nosuchmod:fn"], "dataset = 'nosuchmod:fn': custom dataset"),
        (["--model", "cnn2d"], "model = 'cnn2d': model 'cnn2d' needs input_shape"),
        pytest.param(["--device", "cuda"], "device = 'cuda': device 'cuda'", marks=NO_GPU),
        (["--partition", "shards:100000"], "partition = 'shards:100000': partition spec"),
        (["--threads", "-1"], "--threads -1: use 0 (torch's choice) to 4096"),
        (["--threads", "99999999999"], "--threads 99999999999: use 0 (torch's choice) to"),
        (["--listen", "tcp://127.0.0.1:99999"], "--listen 'tcp://127.0.0.1:99999': port '99999'"),
        (["--bootstrap", "tcp://127.0.0.1:99999"], "--bootstrap 'tcp://127.0.0.1:99999': port"),
        (["--advertise", "tcp://10.0.0.5:99999"], "advertise = 'tcp://10.0.0.5:99999': port"),
    ],
)
def test_a_peer_refuses_what_cannot_run_in_one_line_before_it_listens(
    args: list[str], says: str, tmp_path: Path
) -> None:
    """A review's probes: `run` checked these before any peer started, `peer` did not: a
    traceback each, a shard split the founder found impossible only once the joiner came,
    a port past 65535 wrapped round to another (99999: 34463)."""
    out = tmp_path / "run"
    said = fails("peer", *BY_HAND, "--out", str(out), *args)
    assert says in said, said
    assert not out.exists()  # refused before the run directory


def test_join_checks_the_swarms_config_and_its_own_values_before_it_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swarm = to_dict(small_config(tmp_path, peers=2, partition="shards:100000"))
    monkeypatch.setattr(bootstrap, "fetch_swarm_info", lambda *a, **k: {"config": swarm})
    out = str(tmp_path / "j")
    anywhere = ["--listen", "tcp://0.0.0.0:0"]  # the member is another machine
    said = fails("join", "tcp://10.0.0.5:5555", "--out", out, *anywhere)
    assert "partition = 'shards:100000': partition spec" in said, said
    for args, says in [
        (["--threads", "-1", *anywhere], "--threads -1: use 0"),
        (["--listen", "tcp://0.0.0.0:65536"], "--listen 'tcp://0.0.0.0:65536': port '65536'"),
    ]:
        assert says in fails("join", "tcp://10.0.0.5:5555", "--out", out, *args)
    assert "ADDRESS 'tcp://10.0.0.5:70000': port '70000'" in fails("join", "tcp://10.0.0.5:70000")
    assert not Path(out).exists()


def test_a_server_refuses_what_cannot_run_in_one_line(tmp_path: Path) -> None:
    ps = write_config(tmp_path / "ps.toml", small_config(tmp_path, mode="ps", peers=2))
    assert "--listen 'tcp://127.0.0.1:99999'" in fails(
        "server", "--config", str(ps), "--listen", "tcp://127.0.0.1:99999"
    )
    nodata = small_config(tmp_path, mode="ps", peers=2, dataset="cifar10", data_dir="nodata")
    said = fails("server", "--config", str(write_config(tmp_path / "n.toml", nodata)))
    assert "dataset = 'cifar10': cifar10: nodata" in said, said


def test_a_peer_shares_an_out_with_its_swarm_but_refuses_another_runs(tmp_path: Path) -> None:
    """Two hand-started swarms one after the other into one --out mixed their runs (two lives
    in peers/0.jsonl, the first run's config.toml kept, a summary of both); the peers of
    one swarm on one machine may still share it (each writes peers/<id>.jsonl)."""
    config = small_config(tmp_path, peers=2, steps=60)
    path = write_config(tmp_path / "exp.toml", config)
    run = RunDir(config.out)
    prepare_run_dir(run, config, 0, resume=False)  # as the first swarm's founder did
    recorded = run.config.read_text()
    said = fails("peer", "--config", str(path), "--steps", "40", "--lr", "0.01",
                 "--startup-timeout", "3")  # fmt: skip
    assert "already holds another run (steps = 60 there, 40 here; lr = 0.1 there" in said, said
    run.metrics(0).write_text('{"peer":0,"step":0}\n')
    said = fails("peer", "--config", str(path), "--startup-timeout", "3")
    assert "already holds a run with a peer 0" in said and "--rank 0 to carry" in said, said
    assert run.config.read_text() == recorded
    # The same swarm's peer 1, with this machine's own settings, and peer 0 resumed: welcome;
    # peer 0 resumed with other steps would train on alone: refused.
    ours = config.replace(threads=4, device="cpu", advertise="tcp://10.0.0.7:5555")
    prepare_run_dir(run, ours, 1, resume=False)
    prepare_run_dir(run, ours, 0, resume=True)
    with pytest.raises(ConfigError, match=r"--resume .* \(steps = 60 there, 80 here\)"):
        prepare_run_dir(run, config.replace(steps=80), 0, resume=True)
    assert run.config.read_text() == recorded


def test_a_loopback_listen_dialling_another_machine_fails_at_once_naming_the_fix(
    tmp_path: Path,
) -> None:
    """A review's probe: with the default --listen tcp://127.0.0.1:0 the member's answers
    went to its own loopback; `join` waited 30 s and `peer --bootstrap` its startup_timeout,
    then blamed the member."""
    far = "tcp://192.0.2.1:5555"  # TEST-NET-1: no machine of ours, and never dialled here
    out = str(tmp_path / "j")
    began = time.monotonic()
    for said in (
        fails("join", far, "--out", out),
        fails("peer", *BY_HAND, "--bootstrap", far, "--out", out),
        fails("join", far, "--out", out, "--listen", "tcp://0.0.0.0:0", "--advertise",
              "tcp://127.0.0.1:5556"),
    ):  # fmt: skip
        assert "is another machine" in said and "--listen tcp://0.0.0.0:0" in said, said
        assert "--advertise" in said, said
    assert time.monotonic() - began < 5  # no wait for an answer, no connection tried
    assert not Path(out).exists()
    cli._check_answerable("tcp://127.0.0.1:0", None, {"ADDRESS": "tcp://localhost:5"})
    cli._check_answerable("tcp://127.0.0.1:0", "tcp://10.0.0.7:1", {"ADDRESS": far})
    for ip in interface_ips():  # this machine's own address: its loopback answers reach us
        cli._check_answerable("tcp://127.0.0.1:0", None, {"ADDRESS": f"tcp://{ip}:5"})


def test_join_on_a_listen_port_in_use_is_one_error_line(tmp_path: Path) -> None:
    """A review's probe: the port taken printed a TransportError traceback."""
    ctx = zmq.Context()
    member = ctx.socket(zmq.ROUTER)  # a ZeroMQ listener, so the join gets as far as binding
    try:
        port = member.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
        said = fails("join", address, "--listen", address, "--timeout", "2",
                     "--out", str(tmp_path / "j"))  # fmt: skip
    finally:
        member.close(linger=0)
        ctx.term()
    assert f"cannot listen on {address}" in said and "Traceback" not in said, said
