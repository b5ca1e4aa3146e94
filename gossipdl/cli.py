"""The ``gossipdl`` command line: parses flags, builds a Config, calls the library."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from gossipdl.config import (
    DEFAULTS,
    FIELDS,
    Config,
    ConfigError,
    load_config,
    read_config_file,
    to_toml,
)
from gossipdl.rundir import RunDir, default_run_dir
from gossipdl.transport.curve import Curve, CurveError

app = typer.Typer(
    help="Decentralized (gossip) deep learning over ZeroMQ: no central server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
topology_app = typer.Typer(help="Inspect communication topologies.", no_args_is_help=True)
app.add_typer(topology_app, name="topology")
keys_app = typer.Typer(help="CurveZMQ key pairs for --secure swarms.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)


def _opt(name: str, *flags: str) -> Any:
    """A flag for config field ``name``: unset (None) unless given, its default in the help."""
    default = getattr(DEFAULTS, name)
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    return typer.Option(
        None,
        *flags,
        help=escape(
            f"{FIELDS[name].metadata['help']} [default: {shown if shown != '' else 'none'}]"
        ),
        show_default=False,
    )


def _fail(message: str) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(message)}")  # it may quote a peer's words
    raise typer.Exit(2)


def _setup_logging(rich: bool, level: int = logging.INFO) -> None:
    handler: logging.Handler = (
        RichHandler(console=console, show_path=False) if rich else logging.StreamHandler(sys.stderr)
    )
    if not rich:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


@app.command()
def run(
    config_file: Path | None = typer.Argument(
        None, help="TOML experiment file; flags override it."
    ),
    mode: str | None = _opt("mode"),
    peers: int | None = _opt("peers"),
    topology: str | None = _opt("topology"),
    algorithm: str | None = _opt("algorithm"),
    ps: str | None = _opt("ps"),
    staleness: str | None = _opt("staleness"),
    ps_shards: int | None = _opt("ps_shards", "--ps-shards"),
    local_epochs: int | None = _opt("local_epochs", "--local-epochs"),
    fraction: float | None = _opt("fraction"),
    trigger: str | None = _opt("trigger"),
    codec: str | None = _opt("codec"),
    gamma: float | None = _opt("gamma"),
    loss: float | None = _opt("loss"),
    slowdown: str | None = _opt("slowdown"),
    drift: str | None = _opt("drift"),
    dataset: str | None = _opt("dataset"),
    model: str | None = _opt("model"),
    hidden: str | None = _opt("hidden"),
    partition: str | None = _opt("partition"),
    steps: int | None = _opt("steps"),
    batch_size: int | None = _opt("batch_size", "--batch-size"),
    optimizer: str | None = _opt("optimizer"),
    lr: float | None = _opt("lr"),
    lr_schedule: str | None = _opt("lr_schedule", "--lr-schedule"),
    momentum: float | None = _opt("momentum"),
    weight_decay: float | None = _opt("weight_decay", "--weight-decay"),
    seed: int | None = _opt("seed"),
    eval_every: int | None = _opt("eval_every", "--eval-every"),
    log_every: int | None = _opt("log_every", "--log-every"),
    round_timeout: float | None = _opt("round_timeout", "--round-timeout"),
    startup_timeout: float | None = _opt("startup_timeout", "--startup-timeout"),
    link: str | None = _opt("link"),
    heartbeat: float | None = _opt("heartbeat"),
    dead_after: float | None = _opt("dead_after", "--dead-after"),
    checkpoint_every: int | None = _opt("checkpoint_every", "--checkpoint-every"),
    device: str | None = _opt("device"),
    threads: int | None = _opt("threads"),
    max_message_mb: float | None = _opt("max_message_mb", "--max-message-mb"),
    max_message_rate: float | None = _opt("max_message_rate", "--max-message-rate"),
    max_members: int | None = _opt("max_members", "--max-members"),
    forget_after: float | None = _opt("forget_after", "--forget-after"),
    max_queued_mb: float | None = _opt("max_queued_mb", "--max-queued-mb"),
    host: str | None = _opt("host"),
    out: str | None = _opt("out"),
    progress: bool = typer.Option(True, help="Show the live per-peer progress display."),
) -> None:
    """Train a local swarm (default: 4 peers, 1-D CNN on MNIST-1D, ring, dense gossip).

    Device profiles (\\[profiles.NAME] tables: links, slowdown, offline windows per group of
    peers) have no flag: give them in CONFIG_FILE.
    """
    overrides = {k: v for k, v in locals().items() if k in FIELDS}
    _setup_logging(rich=True, level=logging.WARNING)
    try:
        config = load_config(config_file, **overrides)
    except ConfigError as exc:
        _fail(str(exc))
    _launch(config, progress)


def _launch(config: Config, progress: bool) -> dict[str, Any]:
    """Announce, run and tabulate one local swarm; a bad config or launch exits with code 2."""
    from gossipdl.experiments.display import profiles_table, summary_table, unreached_windows
    from gossipdl.experiments.launcher import LaunchError, launch

    try:
        if not config.out:
            config = config.replace(out=str(default_run_dir()))
        console.print(
            f"[bold]gossipdl[/] {config.mode}: {config.processes} peer(s), {_how(config)}, "
            f"{config.model} on {config.dataset} ({config.partition}), {config.steps} steps "
            f"→ {config.out}"
        )
        if config.profiles:
            console.print(profiles_table(config))
        summary = launch(config, progress=progress, console=console)
    except (ConfigError, LaunchError) as exc:
        _fail(str(exc))
    Console().print(summary_table(summary, title=f"gossipdl run · {config.out}"))
    for line in unreached_windows(config, summary):
        console.print(f"[yellow]warning:[/] {line}")
    return summary


@app.command()
def experiment(
    config_file: Path = typer.Argument(..., help="TOML experiment file, e.g. examples/churn.toml."),
    out: str | None = _opt("out"),
    progress: bool = typer.Option(True, help="Show the live per-peer progress display."),
) -> None:
    """Run one experiment file (device profiles, churn, data skew), then draw its report."""
    _setup_logging(rich=True, level=logging.WARNING)
    try:
        config = load_config(config_file, out=out)
    except ConfigError as exc:
        _fail(str(exc))
    summary = _launch(config, progress)
    _report(Path(summary["config"]["out"]))


@app.command()
def sweep(
    config_file: Path = typer.Argument(..., help="TOML experiment file every variant starts from."),
    grid: list[str] = typer.Option(
        ..., help="KEY=V1,V2: one axis of the grid (repeat for more), e.g. codec=none,topk:0.01."
    ),
    out: str | None = _opt("out"),
    progress: bool = typer.Option(True, help="Show the live per-peer progress display."),
) -> None:
    """Run an experiment file over a grid of settings into one directory, then compare them."""
    from gossipdl.experiments.display import sweep_table
    from gossipdl.experiments.sweep import parse_grid, plan, run_sweep

    _setup_logging(rich=True, level=logging.WARNING)
    try:
        base = load_config(config_file)
        axes = parse_grid(grid)
        root = Path(out or base.out or default_run_dir())
        variants = plan(base, axes, root)
    except ConfigError as exc:
        _fail(str(exc))
    console.print(f"[bold]gossipdl sweep[/]: {len(variants)} variants → {root}")

    def one(config: Config) -> dict[str, Any]:
        try:
            return _launch(config, progress)
        except typer.Exit:
            raise RuntimeError(f"the run into {config.out} failed (see above)") from None

    entries = run_sweep(base, axes, root, one)
    Console().print(sweep_table(entries, title=f"gossipdl sweep · {root}"))
    _report(root)
    if any("error" in e for e in entries):
        raise typer.Exit(1)


@app.command()
def report(
    directory: Path = typer.Argument(..., help="A run directory, or a sweep's directory."),
) -> None:
    """Draw PNG plots and a markdown table for a run or a sweep (into DIR/report/)."""
    _report(directory)


def _report(directory: Path) -> None:
    from gossipdl.experiments.report import ReportError, write_report

    try:
        files = write_report(directory)
    except ReportError as exc:
        _fail(str(exc))
    console.print("[bold]report[/]: " + ", ".join(str(f) for f in files))


def _how(config: Config) -> str:
    """How the run combines its workers, in a few words for the banner."""
    every = "" if config.trigger == "always" else f", {config.trigger}"
    if config.mode == "ring":
        what = "gradients" if config.trigger == "always" else f"parameters{every}"
        return f"ring all-reduce of {what}, codec {config.codec}"
    if config.mode == "ps":
        rule = f"async, staleness {config.staleness}" if config.ps == "async" else config.ps
        return f"parameter server ({rule}{every}), {config.ps_shards} shard(s)"
    return f"{config.topology}, {config.algorithm}{every}"


def _stop_on_signals(training: threading.Event, stop: threading.Event) -> None:
    """First SIGINT/SIGTERM while training: finish the step, save, report. Before: abort."""

    def handler(signum: int, frame: object) -> None:
        if not training.is_set():
            raise KeyboardInterrupt
        # Ctrl-C in a terminal reaches the peer and the launcher forwards it again: a second
        # SIGINT running this handler inside the first one's ``stop.set()`` would deadlock on
        # the Event's lock, so later SIGINTs are ignored (SIGTERM then terminates at once).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _train(
    config: Config,
    *,
    rank: int | None,
    listen: str,
    bootstrap: str | None,
    out: str | None,
    local_index: int,
    threads: int | None,
    summary: bool,
    servers: list[str] | None = None,
    resume: bool = False,
    curve: Curve | None = None,
) -> None:
    import torch

    from gossipdl.coordinator import RingError, ServerError
    from gossipdl.experiments.summary import summarize
    from gossipdl.peers.peer import PeerError
    from gossipdl.peers.runner import train_peer
    from gossipdl.transport import TransportError

    if threads:
        torch.set_num_threads(threads)
    run = RunDir(out or config.out or default_run_dir()).create()
    if not run.config.exists():
        run.config.write_text(to_toml(config.replace(out=str(run.root))))
    training, stop = threading.Event(), threading.Event()
    _stop_on_signals(training, stop)

    def announce(address: str) -> None:
        print(f"listening on {address}", flush=True)
        training.set()

    try:
        train_peer(
            config,
            run,
            rank=rank,
            listen=listen,
            bootstrap=bootstrap,
            local_index=local_index,
            stop=stop,
            on_listening=announce,
            servers=servers,
            resume=resume,
            curve=curve,
        )
    except (TransportError, PeerError, RingError, ServerError, ConfigError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted before training started")
    if summary:
        summarize(run)


@app.command()
def peer(
    config_file: Path | None = typer.Option(None, "--config", help="TOML experiment file."),
    listen: str | None = typer.Option(
        None, help="Address to bind (port 0: any free) [default: tcp://127.0.0.1:0]."
    ),
    bootstrap: str | None = typer.Option(None, help="Address of any member of the swarm to join."),
    rank: int | None = typer.Option(
        None,
        help="Peer id to ask for (default: founder 0 / next free; under torchrun or srun: "
        "RANK / SLURM_PROCID).",
    ),
    out: str | None = typer.Option(None, help="Run directory [default: runs/<timestamp>]."),
    threads: int | None = typer.Option(None, help="torch threads [default: torch's choice]."),
    local_index: int = typer.Option(0, help="Index among peers on this host (picks cuda:i)."),
    summary: bool = typer.Option(True, help="Write summary.json when done."),
    servers: str | None = typer.Option(
        None, help="--mode ps: the shards' addresses, comma-separated, shard 0 first."
    ),
    resume: Path | None = typer.Option(
        None,
        help="Run directory to resume --rank in: its config, checkpoint and members "
        "(rejoins through them unless --bootstrap is given).",
    ),
    secure: bool = typer.Option(False, help="CURVE: encrypt, and admit only --allow's keys."),
    keys: Path | None = typer.Option(None, help="--secure: directory with this peer's key pair."),
    allow: Path | None = typer.Option(None, help="--secure: file of allowed public keys."),
) -> None:
    """Run one peer by hand: found a swarm, join one (--bootstrap), or work for --servers.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or srun (SLURM_PROCID,
    SLURM_NTASKS, SLURM_NODELIST) with no --rank or --bootstrap: rank 0 founds the swarm
    on the master address and port, the others join it, and WORLD_SIZE sets the peers.
    """
    from gossipdl.peers.launch_env import LaunchEnvError, from_environment

    _setup_logging(rich=False)
    try:
        if resume is not None:
            config_file = config_file or RunDir(resume).config
            out = str(resume)
        config = load_config(config_file)
        by_hand = rank is not None or bootstrap is not None or servers
        launched = None if by_hand else from_environment(os.environ)
        if launched is not None:
            rank, local_index = launched.rank, launched.local_rank
            bootstrap = None if launched.rank == 0 else launched.bootstrap
            listen = listen or launched.listen
            config = config.replace(peers=launched.world_size)
            logging.getLogger(__name__).info(
                "%s: rank %d of %d, swarm at %s",
                launched.source,
                rank,
                launched.world_size,
                launched.bootstrap,
            )
        if resume is not None:
            bootstrap = bootstrap or _rejoin_addresses(RunDir(resume), rank)
        curve = _curve(secure, keys, allow)
    except (ConfigError, LaunchEnvError, CurveError) as exc:
        _fail(str(exc))
    _train(
        config,
        rank=rank,
        listen=listen or "tcp://127.0.0.1:0",
        bootstrap=bootstrap,
        out=out,
        local_index=local_index,
        threads=threads,
        summary=summary,
        servers=servers.split(",") if servers else None,
        resume=resume is not None,
        curve=curve,
    )


def _curve(secure: bool, keys: Path | None, allow: Path | None) -> Curve | None:
    """The CURVE settings --secure asks for (None without it)."""
    from gossipdl.transport.curve import load_curve

    if not secure:
        if keys or allow:
            raise ConfigError("--keys and --allow take effect only with --secure")
        return None
    if keys is None or allow is None:
        raise ConfigError("--secure needs --keys DIR (this peer's key pair) and --allow FILE")
    return load_curve(keys, allow)


@keys_app.command("generate")
def keys_generate(
    directory: Path = typer.Argument(..., help="Where to write NAME.key and NAME.key_secret."),
    name: str = typer.Option("peer", help="File name stem."),
) -> None:
    """Write a new CurveZMQ key pair; share the .key (public) line, keep .key_secret."""
    from gossipdl.transport.curve import generate_keys, load_curve_public

    try:
        public, secret = generate_keys(directory, name)
    except CurveError as exc:
        _fail(str(exc))
    print(f"{load_curve_public(public)}  # {name}, public key (add this line to --allow files)")
    print(f"secret key: {secret} (keep it private)", file=sys.stderr)


def _rejoin_addresses(run: RunDir, rank: int | None) -> str:
    """The other members' addresses from ``peers.json``, comma-separated, for --resume."""
    if rank is None:
        raise ConfigError("--resume needs --rank: which peer of the run to restart")
    others = [a for i, a in sorted(run.member_addresses().items()) if i != rank]
    if not others:
        raise ConfigError(
            f"{run.peers_json} lists no other member to rejoin through; give --bootstrap"
        )
    return ",".join(others)


@app.command()
def server(
    config_file: Path = typer.Option(..., "--config", help="TOML experiment file (mode = ps)."),
    shard: int = typer.Option(0, help="Which shard of the parameters this server holds."),
    listen: str = typer.Option("tcp://127.0.0.1:0", help="Address to bind (port 0: any free)."),
    out: str | None = typer.Option(None, help="Run directory [default: the config's out]."),
    secure: bool = typer.Option(False, help="CURVE: encrypt, and admit only --allow's keys."),
    keys: Path | None = typer.Option(None, help="--secure: directory with this server's key pair."),
    allow: Path | None = typer.Option(None, help="--secure: file of allowed public keys."),
) -> None:
    """Run one parameter-server shard (``--mode ps``); workers find it with --servers."""
    from gossipdl.peers.runner import run_shard
    from gossipdl.transport import TransportError

    _setup_logging(rich=False)
    try:
        curve = _curve(secure, keys, allow)
        config = load_config(config_file)
        if config.mode != "ps" or not 0 <= shard < config.ps_shards:
            raise ConfigError(
                f"a server needs mode = 'ps' and 0 <= shard < ps_shards; got mode = "
                f"{config.mode!r}, shard {shard}, ps_shards = {config.ps_shards}"
            )
        run_dir = RunDir(out or config.out or default_run_dir()).create()
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())

        def announce(address: str) -> None:
            print(f"listening on {address}", flush=True)

        run_shard(config, shard, listen, run_dir, on_listening=announce, stop=stop, curve=curve)
    except (ConfigError, TransportError, CurveError) as exc:
        _fail(str(exc))


@app.command()
def join(
    address: str = typer.Argument(..., help="Address of any member, e.g. tcp://10.0.0.5:5555."),
    listen: str = typer.Option("tcp://127.0.0.1:0", help="Address to bind (port 0: any free)."),
    rank: int | None = typer.Option(None, help="Peer id to ask for [default: next free]."),
    out: str | None = typer.Option(None, help="Run directory [default: runs/<timestamp>]."),
    threads: int | None = typer.Option(None, help="torch threads [default: torch's choice]."),
    timeout: float = typer.Option(30.0, help="Seconds to wait for the member to answer."),
    config_file: Path | None = typer.Option(
        None,
        "--config",
        help="Your own TOML file: its keys win over the swarm's. A plug-in (module:function) "
        "or edge file the swarm names runs only if this file names it too.",
    ),
    secure: bool = typer.Option(False, help="CURVE: encrypt, and admit only --allow's keys."),
    keys: Path | None = typer.Option(None, help="--secure: directory with this peer's key pair."),
    allow: Path | None = typer.Option(None, help="--secure: file of allowed public keys."),
) -> None:
    """Join a running swarm: fetch its config, take a neighbour's model, train.

    The swarm's config may name only gossipdl's built-in parts; this machine's own settings
    (run directory, device, limits) come from --config or the defaults, never from the swarm.
    """
    from gossipdl.peers.bootstrap import fetch_swarm_info
    from gossipdl.peers.peer import PeerError
    from gossipdl.trust import config_from_peer

    _setup_logging(rich=False)
    try:
        curve = _curve(secure, keys, allow)
        local = read_config_file(config_file) if config_file is not None else {}
        info = fetch_swarm_info(address, listen=listen, timeout=timeout, curve=curve)
        config = config_from_peer(info["config"], address, local)
    except (PeerError, ConfigError, CurveError) as exc:
        _fail(str(exc))
    _train(
        config,
        rank=rank,
        listen=listen,
        bootstrap=address,
        out=out,
        local_index=0,
        threads=threads,
        summary=True,
        curve=curve,
    )


@topology_app.command("show")
def topology_show(
    name: str = typer.Argument(..., help="Topology spec, e.g. ring, torus:4x4, random-regular:3."),
    n: int = typer.Option(8, "-n", "--peers", help="Number of peers."),
    seed: int = typer.Option(0, help="Seed for random topologies."),
) -> None:
    """Print neighbour lists, the mixing matrix and its spectral gap."""
    from gossipdl.topologies import TopologyError, build_topology, format_topology

    try:
        topology = build_topology(name, n, seed)
    except TopologyError as exc:
        _fail(str(exc))
    print(format_topology(topology))


def main() -> None:
    """Console-script entry point; ``module:function`` specs resolve from the current directory."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    app()
