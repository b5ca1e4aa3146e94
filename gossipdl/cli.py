"""The ``gossipdl`` command line: parses flags, builds a Config, calls the library."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from gossipdl.experiments import forking

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch for transparent huge pages on CPU buffers of 2 MB or more, read at torch's
first large allocation."""


def use_huge_pages() -> None:
    """Turn torch's huge pages on unless the user set :data:`HUGE_PAGES_ENV` (0 keeps 4 KB
    pages): a fresh 40 MB tensor then costs 20 page faults instead of 10,000, and a
    10.7M-parameter MLP's training step ran 20% faster on the 2-core VM, peers' memory
    unchanged. Call it before torch allocates a large tensor (benchmarks do, as here)."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


use_huge_pages()  # before torch, and before the fork server starts
forking.warm_up_for(sys.argv)  # before the imports below bring torch in: they overlap

from gossipdl.config import (  # noqa: E402
    ADVERTISE_ENV,
    DEFAULTS,
    FIELDS,
    MAX_THREADS,
    TABLE_KEYS,
    Config,
    ConfigError,
    load_config,
    parse_setting,
    parse_value,
    read_config_file,
    resolved,
)
from gossipdl.experiments.orphans import stop_with_launcher  # noqa: E402
from gossipdl.rundir import RUN_START_ENV, RunDir, default_run_dir  # noqa: E402
from gossipdl.transport.curve import Curve, CurveError  # noqa: E402

log = logging.getLogger(__name__)
console = Console(stderr=True, emoji=False)  # what a user typed, as typed: no :name: emoji


def _interrupted(line: str, code: int = 130) -> NoReturn:
    """Ctrl-C's one line, then exit ``code`` (130 = 128 + SIGINT, as shells report it)."""
    console.print(line)
    raise typer.Exit(code)


class _Help:
    """Help that reads well at 80 columns: a paragraph of a docstring is one line, so the
    terminal wraps it; a flag shows no ``<bool>`` type (``--x/--no-x`` says it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("help"):
            paragraphs = inspect.cleandoc(kwargs["help"]).split("\n\n")
            kwargs["help"] = "\n\n".join(" ".join(p.split()) for p in paragraphs)
        super().__init__(*args, **kwargs)

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False):
                param.metavar = ""
        return params


class _Command(_Help, TyperCommand):
    """A gossipdl command."""


class _Group(_Help, TyperGroup):
    """The gossipdl command group: Ctrl-C anywhere in a command ends it with exit code 130
    (or the code an interrupted run carries, 128 + its signal) and one line."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            _interrupted("interrupted", getattr(exc, "exit_code", 130))


class _Typer(typer.Typer):
    """A typer app whose commands are :class:`_Command` and groups :class:`_Group`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=_Group, no_args_is_help=True, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Any:
        return super().command(*args, cls=_Command, **kwargs)


app = _Typer(add_completion=False, pretty_exceptions_enable=False)  # help: _root's docstring
topology_app = _Typer(help="Inspect communication topologies.")
app.add_typer(topology_app, name="topology")
keys_app = _Typer(help="CurveZMQ key pairs for --secure swarms.")
app.add_typer(keys_app, name="keys")
data_app = _Typer(help="Published data sets: fetch them once, then train on them.")
app.add_typer(data_app, name="data")

SWARM, DATA, OPTIMISATION = "Swarm", "Data and model", "Optimisation"
COMMUNICATION, FAULTS, OUTPUT = "Communication", "Faults and links", "Output"
_PANELS = {
    SWARM: ("mode", "peers", "topology", "ps", "ps_shards", "host", "advertise", "device",
            "threads", "batched", "startup_timeout", "heartbeat", "dead_after", "max_members",
            "forget_after"),
    DATA: ("dataset", "data_dir", "samples_per_peer", "model", "hidden", "partition", "seed"),
    OPTIMISATION: ("steps", "batch_size", "optimizer", "lr", "lr_schedule", "momentum",
                   "weight_decay", "staleness", "local_epochs", "fraction"),
    COMMUNICATION: ("algorithm", "trigger", "codec", "gamma", "defence", "evict_after", "overlap",
                    "shared_memory", "round_timeout", "max_message_mb", "max_message_rate",
                    "max_queued_mb"),
    FAULTS: ("loss", "slowdown", "drift", "link"),
    OUTPUT: ("out", "eval_every", "log_every", "checkpoint_every", "tensorboard", "csv",
             "metrics_hook"),
}  # fmt: skip
_PANEL_OF = {name: panel for panel, names in _PANELS.items() for name in names}
_FLAG_TYPES: dict[str, type] = {
    "int": int, "float": float, "str": str, "bool": bool, "tuple[int, ...]": str
}  # fmt: skip
_KEYWORD = inspect.Parameter.KEYWORD_ONLY
_SET = typer.Option(
    [],
    "--set",
    metavar="KEY=VALUE",
    help="Any config key, e.g. --set steps=300 --set codec=topk:0.01 (repeat it); VALUE is "
    "read as TOML (300 a number, [64, 32] a list), else as text.",
    show_default=False,
    rich_help_panel=SWARM,
)
_PROGRESS = typer.Option(
    True, help="Show the live per-peer progress display.", rich_help_panel=OUTPUT
)
_STEP_TIME = typer.Option(
    None,
    help="Simulated: the host's step time (e.g. 250ms), which a profile's slowdown scales "
    "\\[default: measured once on this host].",
    rich_help_panel=OUTPUT,
)


def _opt(name: str, envvar: str | None = None) -> Any:
    """The flag for config key ``name``: unset (None) unless given, its default in the help."""
    default = getattr(DEFAULTS, name)
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    return typer.Option(
        None,
        f"--{name.replace('_', '-')}",
        help=escape(
            f"{FIELDS[name].metadata['help']} [default: {shown if shown != '' else 'none'}]"
        ),
        show_default=False,
        envvar=envvar,
        rich_help_panel=_PANEL_OF[name],  # a new config key needs a panel in _PANELS
    )


def _config_options(
    *, own: tuple[str, ...] = (), envvars: Mapping[str, str] | None = None
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command a flag per config key (except ``own``: its own flags of those names;
    ``TABLE_KEYS``, tables, come from the file or --set) and ``--set KEY=VALUE``; it gets what
    they set as one keyword argument ``overrides``. ``envvars``: key -> environment variable
    read when its flag is not given. Help: the command's own options, then the panels."""
    names = [name for name in FIELDS if name not in (*own, *TABLE_KEYS)]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        params = [p for p in signature.parameters.values() if p.name != "overrides"]
        params.append(inspect.Parameter("settings", _KEYWORD, default=_SET, annotation=list[str]))
        params += [
            inspect.Parameter(
                name,
                _KEYWORD,
                default=_opt(name, (envvars or {}).get(name)),
                annotation=_FLAG_TYPES[str(FIELDS[name].type)] | None,
            )
            for name in names
        ]
        params.sort(key=_help_order)

        @functools.wraps(command)
        def with_overrides(*, settings: list[str], **kwargs: Any) -> None:
            flags = {name: kwargs.pop(name) for name in names}
            try:
                overrides = _overrides(flags, settings)
            except ConfigError as exc:
                _fail(str(exc))
            command(overrides=overrides, **kwargs)

        keyword_only = [p.replace(kind=_KEYWORD) for p in params]
        with_overrides.__signature__ = signature.replace(parameters=keyword_only)  # type: ignore[attr-defined]
        return with_overrides

    return decorate


def _help_order(param: inspect.Parameter) -> tuple[int, int]:
    """Where a parameter shows in the help: arguments and the command's own options first
    (as declared), then each panel in ``_PANELS`` order, its keys in their order there."""
    panel = getattr(param.default, "rich_help_panel", None)
    if panel not in _PANELS:
        return 0, 0
    names = _PANELS[panel]
    return 1 + list(_PANELS).index(panel), names.index(param.name) if param.name in names else -1


def _overrides(flags: dict[str, Any], settings: list[str]) -> dict[str, Any]:
    """The config values a command's flags and ``--set`` arguments give (they win over the
    file); a key given twice is an error, not a silent choice."""
    values = {name: value for name, value in flags.items() if value is not None}
    for text in settings:
        key, value = parse_setting(text)
        if key in values:
            raise ConfigError(
                f"--set {text!r}: {key} is already set (by --{key.replace('_', '-')} or an "
                "earlier --set); give it once"
            )
        values[key] = value
    return values


def _load(config_file: Path | None, overrides: dict[str, Any]) -> Config:
    """The config file under the command's overrides, or exit 2 naming what is wrong."""
    try:
        return load_config(config_file, **overrides)
    except ConfigError as exc:
        _fail(str(exc))


class Failed(typer.Exit):
    """Exit code 2 that keeps its error's message: a sweep lists it for the failed variant."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


def _fail(message: str) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(message)}")  # it may quote a peer's words
    raise Failed(message)


def _setup_logging(rich: bool, level: int = logging.INFO) -> None:
    handler: logging.Handler = (
        RichHandler(console=console, show_path=False) if rich else logging.StreamHandler(sys.stderr)
    )
    if not rich:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def _show_version(value: bool) -> None:
    if value:
        print(version("gossipdl"))
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Decentralized (gossip) deep learning over ZeroMQ: no central server."""


@app.command()
@_config_options()
def run(
    config_file: Path | None = typer.Argument(
        None, help="TOML experiment file; flags override it."
    ),
    progress: bool = _PROGRESS,
    *,
    overrides: dict[str, Any],
) -> None:
    """Train a local swarm (default: 4 peers, 1-D CNN on MNIST-1D, ring, dense gossip).

    Device profiles (\\[profiles.NAME] tables: links, slowdown, offline windows per group of
    peers) have no flag: give them in CONFIG_FILE, or as --set profiles={...}. Fault events
    (\\[\\[faults]] tables) run only under `gossipdl simulate`.
    """
    _setup_logging(rich=True, level=logging.WARNING)
    _launch(_load(config_file, overrides), progress)


def _launch(config: Config, progress: bool) -> dict[str, Any]:
    """Announce, run and tabulate one local swarm; a bad config or launch exits with code 2."""
    from gossipdl.experiments.display import profiles_table, summary_table, unreached_windows
    from gossipdl.experiments.launcher import LaunchError, launch

    try:
        config = resolved(config.replace(out=config.out or str(default_run_dir())))
        console.print(
            f"[bold]gossipdl[/] {config.mode}: {config.processes} peer(s), "
            f"{escape(_how(config))}, {config.model} on {config.dataset} ({config.partition}), "
            f"{config.steps} steps → {escape(config.out)}"
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
@_config_options()
def simulate(
    config_file: Path | None = typer.Argument(
        None, help="TOML experiment file; flags override it."
    ),
    step_time: str | None = _STEP_TIME,
    progress: bool = _PROGRESS,
    faults: str | None = typer.Option(
        None,
        help="random: search for protocol bugs instead, one small swarm under random faults "
        "per seed of --seeds, invariants checked (no config file or flags).",
        rich_help_panel=FAULTS,
    ),
    seeds: str | None = typer.Option(
        None,
        help="With --faults random: seeds A:B (A to B-1), or one seed N to replay it.",
        rich_help_panel=FAULTS,
    ),
    jobs: int = typer.Option(
        0,
        help="With --faults random: worker processes \\[default: one per CPU core].",
        rich_help_panel=FAULTS,
    ),
    *,
    overrides: dict[str, Any],
) -> None:
    """Run the swarm as virtual peers in this process, on virtual time (same flags as run,
    but for --csv, --tensorboard and --metrics-hook: it writes the run directory only).

    The real protocol, encoder and codecs over an in-memory network with the profiles'
    links: deterministic for a seed (give --step-time, or every profile a step_time and no
    slowdown), and
    fast enough for hundreds of peers. Modes gossip, ring and ps (the shards are nodes
    with unshaped links, a server in a data centre). The run directory is the one `run`
    writes, with simulated seconds in `time`; `report` and `sweep` read it.

    Fault events (\\[\\[faults]] tables: at = "30s" and one of kill, leave, restart,
    partition, heal, clog, unclog, clock, inject) come from CONFIG_FILE or
    --set 'faults=[{at="30s", kill="3"}]'. A peer that stopped on an error (a ring that
    lost a member, a ps worker its shards stopped answering, a restart nobody let back
    in) is named after the summary, and the command exits with code 2, as `run` does.

    --faults random --seeds 0:2000 searches for protocol bugs: each seed is a small swarm
    under a random schedule of faults, with invariants checked as it runs. It prints one
    line for the range and exits 0, or for each broken seed the invariant, the events
    before it and the command that replays it, and exits 1.
    """
    _setup_logging(rich=True, level=logging.WARNING)
    if faults is not None or seeds is not None:
        _search_faults(faults, seeds, jobs, config_file, overrides, progress)
        return
    config = _load(config_file, overrides)
    _simulate(config, progress, _step_seconds(step_time))


def _step_seconds(step_time: str | None) -> float | None:
    """``--step-time`` in seconds (None: not given); exit code 2 for one that is no time."""
    from gossipdl.conditions import ConditionError, parse_duration

    try:
        return None if step_time is None else parse_duration(step_time, "--step-time")
    except ConditionError as exc:
        _fail(str(exc))


def _search_faults(
    faults: str | None,
    seeds: str | None,
    jobs: int,
    config_file: Path | None,
    overrides: dict[str, Any],
    progress: bool,
) -> None:
    """``simulate --faults random --seeds A:B``: the fault search; exit 1 if a seed broke."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from gossipdl.experiments import fault_search
    from gossipdl.experiments.launcher import Interrupted, StopOnSignal

    if faults != "random":
        _fail(
            f"--faults {faults!r}: only random is a flag (a schedule of your own goes in "
            "[[faults]] tables of the config file)"
            if faults is not None
            else "--seeds is for the fault search; add --faults random"
        )
    given = sorted(k for k in overrides if k != "out")
    if config_file is not None or given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given) or "the config file"
        _fail(
            f"--faults random draws each seed's swarm itself; drop {flags} (--out says where "
            "broken seeds keep their run directories)"
        )
    try:
        seed_range = fault_search.parse_seeds(seeds or fault_search.SEEDS_EXAMPLE)
    except fault_search.SearchError as exc:
        _fail(str(exc))
    root = Path(overrides.get("out") or default_run_dir())
    root.mkdir(parents=True, exist_ok=True)
    workers = jobs or min(os.cpu_count() or 1, len(seed_range))
    columns = (
        TextColumn("[bold]fault search"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("seeds · {task.fields[broken]} broken"),
    )
    started = time.perf_counter()
    with (
        Progress(*columns, console=console, disable=not progress, transient=True) as bar,
        StopOnSignal() as stop,
    ):
        task = bar.add_task("search", total=len(seed_range), broken=0)

        def seen(outcome: fault_search.Outcome) -> None:
            broken = bar.tasks[task].fields["broken"] + (outcome.violation is not None)
            bar.update(task, advance=1, broken=broken)

        try:
            outcomes = fault_search.search(
                seed_range, str(root), workers, seen, stopped=lambda: stop.signum is not None
            )
        except fault_search.SearchError as exc:
            _fail(str(exc))
    for outcome in outcomes:
        if outcome.violation is not None:
            print(fault_search.report(outcome))
    line = fault_search.summary_line(seed_range, outcomes, time.perf_counter() - started)
    console.print(escape(line), highlight=False)
    if not any(root.iterdir()):
        root.rmdir()
    if stop.signum is not None:  # the line above counts the seeds that ran
        raise Interrupted(stop.signum)
    if any(o.violation is not None for o in outcomes):
        raise typer.Exit(1)


def _simulate(config: Config, progress: bool, step_time: float | None = None) -> dict[str, Any]:
    """Announce, simulate and tabulate one swarm; a config it cannot run exits with code 2."""
    from gossipdl.conditions import ConditionError
    from gossipdl.experiments.display import summary_table
    from gossipdl.experiments.simulated import simulate as run_simulation
    from gossipdl.sim.engine import SimulationError

    try:
        config = resolved(config.replace(out=config.out or str(default_run_dir())))
        console.print(
            f"[bold]gossipdl[/] simulate: {config.peers} virtual peer(s), {escape(_how(config))}, "
            f"{config.model} on {config.dataset} ({config.partition}), {config.steps} steps "
            f"→ {escape(config.out)}"
        )
        with _sim_progress(config, progress) as on_progress:
            summary = run_simulation(config, step_time=step_time, on_progress=on_progress)
    except (ConfigError, SimulationError, ConditionError) as exc:
        _fail(str(exc))
    Console().print(summary_table(summary, title=f"gossipdl simulate · {config.out}"))
    console.print(
        f"simulated {summary['simulated_time_s']:.1f} s of swarm time in "
        f"{summary['host_time_s']:.1f} s on this host"
    )
    failed = summary.get("failed", {})
    if failed:
        _fail("; ".join(f"peer {i} stopped: {why}" for i, why in failed.items()))
    return summary


@contextmanager
def _sim_progress(config: Config, enabled: bool) -> Iterator[Callable[[int, float], None]]:
    """A progress bar over every virtual peer's steps, with the simulated time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (
        TextColumn("[bold]simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps · {task.fields[at]} simulated"),
    )
    with Progress(*columns, console=console, disable=not enabled, transient=True) as bar:
        task = bar.add_task("sim", total=config.peers * config.steps, at="0.0 s")

        def update(steps: int, now: float) -> None:
            bar.update(task, completed=steps, at=f"{now:.1f} s")

        yield update


@app.command()
@_config_options()
def experiment(
    config_file: Path = typer.Argument(..., help="TOML experiment file, e.g. examples/churn.toml."),
    progress: bool = _PROGRESS,
    *,
    overrides: dict[str, Any],
) -> None:
    """Run one experiment file (device profiles, churn, data skew), then draw its report.

    Flags and --set override the file, e.g. --steps 300 for a shorter run.
    """
    _setup_logging(rich=True, level=logging.WARNING)
    summary = _launch(_load(config_file, overrides), progress)
    _report([Path(summary["config"]["out"])], None)


@app.command()
@_config_options()
def sweep(
    config_file: Path = typer.Argument(..., help="TOML experiment file every variant starts from."),
    grid: list[str] = typer.Option(
        ...,
        help="KEY=V1,V2: one axis of the grid (repeat for more), e.g. codec=none,topk:0.01; "
        "a value with commas is bracketed or quoted: 'hidden=[64,32],[128]'.",
        rich_help_panel=SWARM,
    ),
    engine: str = typer.Option(
        "real",
        help="real: every variant as local processes (gossipdl run); sim: simulated "
        "(gossipdl simulate), on virtual time.",
        rich_help_panel=OUTPUT,
    ),
    step_time: str | None = _STEP_TIME,
    progress: bool = _PROGRESS,
    *,
    overrides: dict[str, Any],
) -> None:
    """Run an experiment file over a grid of settings into one directory, then compare them.

    Flags and --set change the file for every variant; --grid varies a key across them.
    """
    if engine not in ("real", "sim"):
        _fail(f"--engine {engine!r}: use real (local processes) or sim (the simulator)")
    if step_time is not None and engine != "sim":
        _fail("--step-time sets the simulator's step: add --engine sim, or give step_time "
              "in the profiles")  # fmt: skip
    seconds = _step_seconds(step_time)
    from gossipdl.experiments.display import sweep_table
    from gossipdl.experiments.simulated import refuse_outside_real
    from gossipdl.experiments.sweep import parse_grid, plan, run_sweep
    from gossipdl.sim.faults import refuse_outside_simulation

    _setup_logging(rich=True, level=logging.WARNING)
    refuse = refuse_outside_simulation if engine == "real" else refuse_outside_real
    try:
        base = load_config(config_file, **overrides)
        axes = {key: [parse_value(key, v) for v in vs] for key, vs in parse_grid(grid).items()}
        root = Path(base.out or default_run_dir())
        variants = plan(base, axes, root)
        for name, _, config in variants:  # before the first runs, not variant by variant
            try:
                refuse(config)
            except ConfigError as exc:
                raise ConfigError(f"variant {name}: {exc}") from None
    except ConfigError as exc:
        _fail(str(exc))
    console.print(f"[bold]gossipdl sweep[/]: {len(variants)} variants → {escape(str(root))}")

    def one(config: Config) -> dict[str, Any]:
        try:
            if engine == "real":
                return _launch(config, progress)
            return _simulate(config, progress, seconds)
        except Failed as exc:  # printed already; sweep.json lists it with the variant
            raise RuntimeError(exc.message) from None

    entries = run_sweep(base, axes, root, one)
    Console().print(sweep_table(entries, title=f"gossipdl sweep · {root}"))
    _report([root], None)
    if any("error" in e for e in entries):
        raise typer.Exit(1)


@app.command()
def report(
    directories: list[Path] = typer.Argument(
        ..., help="Run directories or sweep directories; several are overlaid."
    ),
    out: Path | None = typer.Option(
        None,
        help="Where to write the report \\[default: DIR/report for one directory, "
        "report-<their names>/ in the folder that holds several].",
    ),
) -> None:
    """Draw PNG plots and a markdown table for one or more runs or sweeps, compared."""
    _report(directories, out)


def _report(directories: list[Path], out: Path | None) -> None:
    from gossipdl.experiments.report import ReportError, write_report
    from gossipdl.rundir import RunDirError

    try:
        files = write_report(directories, out)
    except (ReportError, RunDirError) as exc:
        _fail(str(exc))
    console.print("[bold]report[/]: " + ", ".join(escape(str(f)) for f in files))


def _how(config: Config) -> str:
    """How the run combines its workers (algorithm and codec as they run), for the banner."""
    every = "" if config.trigger == "always" else f", {config.trigger}"
    codec = f"codec {config.codec}"
    if config.mode == "single":
        return "one process, no communication"
    if config.mode == "ring":
        what = "gradients" if config.trigger == "always" else f"parameters{every}"
        return f"ring all-reduce of {what}, {codec}"
    if config.mode == "ps":
        rule = f"async, staleness {config.staleness}" if config.ps == "async" else config.ps
        return f"parameter server ({rule}{every}), {config.ps_shards} shard(s), {codec}"
    config = resolved(config)
    step = f"{config.gamma:g}" if config.gamma else "auto"
    gamma = f" (γ {step})" if config.algorithm in ("choco", "powergossip") else ""
    return f"{config.topology}, {config.algorithm}{gamma}{every}, {codec}"


class _Signalled:
    """The signal (SIGINT or SIGTERM) that stopped a command in order; None while none came."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def exit_if_caught(self) -> None:
        """After the orderly stop (the final line, the summary written): end as ``run`` does,
        with the one ``interrupted`` line and exit code 128 + the signal (130, 143)."""
        from gossipdl.experiments.launcher import Interrupted

        if self.signum is not None:
            raise Interrupted(self.signum)


def _stop_on_signals(training: threading.Event, stop: threading.Event) -> _Signalled:
    """First SIGINT/SIGTERM while training: finish the step, save, report, and it is kept in
    the returned record for the exit code. Before: abort, exiting 128 + the signal
    (:class:`~gossipdl.experiments.launcher.Interrupted`)."""
    from gossipdl.experiments.launcher import Interrupted

    signalled = _Signalled()

    def handler(signum: int, frame: object) -> None:
        if not training.is_set():
            raise Interrupted(signum)
        # Ctrl-C in a terminal reaches the peer and the launcher forwards it again: a second
        # SIGINT running this handler inside the first one's ``stop.set()`` would deadlock on
        # the Event's lock, so later SIGINTs are ignored (SIGTERM then terminates at once).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signalled.signum = signum
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    stop_with_launcher()  # started by `gossipdl run`: stop with it
    return signalled


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
    launched: bool = False,
) -> None:
    """Run one peer of a swarm into its run directory; what cannot run (data, model,
    partition, device, threads, a directory of another run) exits 2 before it listens.
    Ctrl-C or SIGTERM exits 128 + the signal: before training at once, after in order.
    ``launched``: every rank started at once, so rank 0 may not listen yet."""
    import torch

    from gossipdl.coordinator import RingError, ServerError
    from gossipdl.data import DataError
    from gossipdl.experiments.summary import summarize
    from gossipdl.models import ModelError
    from gossipdl.peers.peer import PeerError
    from gossipdl.peers.runner import prepare_run_dir, train_peer
    from gossipdl.transport import TransportError
    from gossipdl.transport.probe import CONNECT_WAIT_S

    founder = bootstrap is None and servers is None
    own_id = rank if rank is not None else (0 if founder else None)  # a joiner's: the swarm's
    run = RunDir(out or config.out or default_run_dir())
    try:
        _check_threads(threads)
        if RUN_START_ENV not in os.environ:  # `gossipdl run` checked all this before it began
            _preflight(config)
        prepare_run_dir(run, config, own_id, resume=resume)
    except ConfigError as exc:
        _fail(str(exc))
    if threads:
        torch.set_num_threads(threads)
    log.info("%s: %s", config.mode, _how(config))
    training, stop = threading.Event(), threading.Event()
    signalled = _stop_on_signals(training, stop)

    def announce(address: str) -> None:
        print(f"listening on {address}", flush=True)

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
            on_training=training.set,
            servers=servers,
            resume=resume,
            curve=curve,
            connect_wait=config.startup_timeout if launched else CONNECT_WAIT_S,
        )
    except (TransportError, PeerError, RingError, ServerError, ConfigError) as exc:
        _fail(str(exc))
    except (DataError, ModelError) as exc:  # past the preflight: the data changed meanwhile
        _fail(str(exc))
    except KeyboardInterrupt as exc:
        _interrupted("interrupted before training started", getattr(exc, "exit_code", 130))
    if summary:
        summarize(run)
    signalled.exit_if_caught()


def _check_threads(threads: int | None) -> None:
    """ConfigError for a --threads torch cannot take (it fails on a negative count mid-start)."""
    if threads is not None and not 0 <= threads <= MAX_THREADS:
        raise ConfigError(f"--threads {threads}: use 0 (torch's choice) to {MAX_THREADS}")


def _preflight(config: Config) -> None:
    """The checks ``run`` makes before any peer starts, made by one peer before it listens or
    joins: data present, partition possible, device here, model fits the data; ConfigError
    naming the key. Simulated faults are refused too (only ``simulate`` runs them)."""
    from gossipdl.experiments.launcher import preflight
    from gossipdl.sim.faults import refuse_outside_simulation

    refuse_outside_simulation(config)
    preflight(config)


def _check_addresses(listen: str | None, dialled: dict[str, str | None]) -> None:
    """ConfigError naming the flag whose address a socket would misread: ``listen`` binds (any
    host, port 0 for any free one); ``dialled`` (flag -> comma-separated addresses, None: not
    given) are dialled, each one machine's port. ZeroMQ wraps a port past 65535 round."""
    from gossipdl.transport.address_syntax import address_problem, listen_problem

    problem = listen_problem(listen) if listen is not None else None
    if problem is not None:
        raise ConfigError(f"--listen {listen!r}: {problem}")
    given = {flag: value for flag, value in dialled.items() if value is not None}
    for flag, value in given.items():
        for address in (a.strip() for a in value.split(",")):
            problem = address_problem(address)
            if problem is not None:
                raise ConfigError(f"{flag} {address!r}: {problem}")


def _check_answerable(listen: str, advertise: str | None, dialled: dict[str, str | None]) -> None:
    """ConfigError, before any wait, when the address we tell others to answer (``advertise``,
    else ``listen``) only reaches this machine and a ``dialled`` address (flag -> comma-separated
    addresses) is on another one: its replies would go to that machine's own loopback, and
    we would wait out the whole timeout blaming it."""
    from gossipdl.transport.addresses import is_loopback

    ours = advertise or listen
    if not is_loopback(ours):
        return
    for flag, value in dialled.items():
        for address in (a.strip() for a in str(value or "").split(",") if a.strip()):
            if not _on_this_machine(address):
                raise ConfigError(
                    f"{flag} {address} is another machine, but we would tell it to answer at "
                    f"{ours}, which only this machine reaches: listen on every interface with "
                    "--listen tcp://0.0.0.0:0, or give --advertise tcp://HOST:PORT with an "
                    "address it reaches"
                )


def _on_this_machine(address: str) -> bool:
    """Whether ``address``'s host is this machine: a loopback address, or one of its own
    (a host name is resolved, within ``RESOLVE_TIMEOUT_S``; one that does not resolve is
    left to the start, which names it)."""
    import ipaddress
    import socket

    from gossipdl.transport.address_syntax import host_port
    from gossipdl.transport.addresses import ResolveError, resolve

    try:
        ip = host_port(resolve(address, "address"))[0].strip("[]")
    except (ResolveError, ValueError):
        return True
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        return True
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # binds only to our own IPs
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
        return True


@app.command()
@_config_options(own=("out", "threads"), envvars={"advertise": ADVERTISE_ENV})
def peer(
    config_file: Path | None = typer.Option(
        None, "--config", help="TOML experiment file; flags override it."
    ),
    listen: str | None = typer.Option(
        None, help="Address to bind (port 0: any free) \\[default: tcp://127.0.0.1:0]."
    ),
    bootstrap: str | None = typer.Option(None, help="Address of any member of the swarm to join."),
    rank: int | None = typer.Option(
        None,
        help="Peer id to ask for (default: founder 0 / next free; under torchrun or srun: "
        "RANK / SLURM_PROCID).",
    ),
    out: str | None = typer.Option(
        None, help="Run directory \\[default: runs/<timestamp>].", rich_help_panel=OUTPUT
    ),
    threads: int | None = typer.Option(
        None, help="torch threads \\[default: torch's choice].", rich_help_panel=SWARM
    ),
    local_index: int = typer.Option(0, help="Index among peers on this host (picks cuda:i)."),
    summary: bool = typer.Option(
        True, help="Write summary.json when done.", rich_help_panel=OUTPUT
    ),
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
    *,
    overrides: dict[str, Any],
) -> None:
    """Run one peer by hand: found a swarm, join one (--bootstrap), or work for --servers.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or srun (SLURM_PROCID,
    SLURM_NTASKS, SLURM_NODELIST) with no --rank or --bootstrap: rank 0 founds the swarm
    on the master address and port, the others join it, and WORLD_SIZE sets the peers.
    """
    from gossipdl.peers.launch_env import LaunchEnvError, from_environment

    _setup_logging(rich=False)
    try:
        _check_addresses(listen, {"--bootstrap": bootstrap, "--servers": servers})
        if resume is not None:
            if out is not None and Path(out).resolve() != resume.resolve():
                raise ConfigError(
                    f"--resume {resume} carries the peer on in that run directory; drop --out {out}"
                )
            config_file = config_file or RunDir(resume).config
            out = str(resume)
        config = load_config(config_file, **overrides)
        by_hand = rank is not None or bootstrap is not None or servers
        launched = None if by_hand else from_environment(os.environ)
        if launched is not None:
            rank, local_index = launched.rank, launched.local_rank
            bootstrap = None if launched.rank == 0 else launched.bootstrap
            listen = listen or launched.listen
            config = config.replace(peers=launched.world_size)
            log.info(
                "%s: rank %d of %d, swarm at %s",
                launched.source,
                rank,
                launched.world_size,
                launched.bootstrap,
            )
        if resume is not None:
            bootstrap = bootstrap or _rejoin_addresses(RunDir(resume), rank)
        listen = listen or "tcp://127.0.0.1:0"
        _check_answerable(
            listen, config.advertise or None, {"--bootstrap": bootstrap, "--servers": servers}
        )
        curve = _curve(secure, keys, allow)
    except (ConfigError, LaunchEnvError, CurveError) as exc:
        _fail(str(exc))
    _train(
        config,
        rank=rank,
        listen=listen,
        bootstrap=bootstrap,
        out=out,
        local_index=local_index,
        threads=threads,
        summary=summary,
        servers=servers.split(",") if servers else None,
        resume=resume is not None,
        curve=curve,
        launched=launched is not None,
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


@data_app.command("fetch")
def data_fetch(
    name: str = typer.Argument(..., help="cifar10 | cifar100 | femnist | shakespeare"),
    data_dir: Path | None = typer.Option(
        None, help="Where to keep it \\[default: $GOSSIPDL_DATA or ~/.cache/gossipdl/data]."
    ),
    url: str | None = typer.Option(
        None, help="A mirror of the archive; its published MD5 and size are still checked."
    ),
) -> None:
    """Download a data set, check its published checksum and keep its files. Ctrl-C or
    SIGTERM stops it (exit 130 or 143) with nothing half-written left."""
    from dataclasses import replace

    from gossipdl.data.fetch import SOURCES, FetchError, fetch
    from gossipdl.experiments.launcher import StopOnSignal

    source = replace(SOURCES[name], url=url) if url and name in SOURCES else None
    try:
        with StopOnSignal(at_once=True):  # SIGTERM unwinds as Ctrl-C does: files removed
            kept = fetch(name, data_dir, source, progress=console.is_terminal, console=console)
    except FetchError as exc:
        _fail(str(exc))
    console.print(f"[bold]{name}[/]: " + ", ".join(escape(str(p)) for p in kept))


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
    out: str | None = typer.Option(None, help="Run directory \\[default: the config's out]."),
    secure: bool = typer.Option(False, help="CURVE: encrypt, and admit only --allow's keys."),
    keys: Path | None = typer.Option(None, help="--secure: directory with this server's key pair."),
    allow: Path | None = typer.Option(None, help="--secure: file of allowed public keys."),
) -> None:
    """Run one parameter-server shard (--mode ps); workers find it with --servers."""
    from gossipdl.peers.runner import run_shard
    from gossipdl.transport import TransportError

    _setup_logging(rich=False)
    try:
        _check_addresses(listen, {})
        curve = _curve(secure, keys, allow)
        config = load_config(config_file)
        if config.mode != "ps" or not 0 <= shard < config.ps_shards:
            raise ConfigError(
                f"a server needs mode = 'ps' and 0 <= shard < ps_shards; got mode = "
                f"{config.mode!r}, shard {shard}, ps_shards = {config.ps_shards}"
            )
        _preflight(config.replace(device="cpu"))  # a server trains nothing: no GPU needed
        run_dir = RunDir(out or config.out or default_run_dir()).create()
        stop, serving = threading.Event(), threading.Event()
        serving.set()  # a signal stops it in order at any time: its counters are written
        signalled = _stop_on_signals(serving, stop)

        def announce(address: str) -> None:
            print(f"listening on {address}", flush=True)

        run_shard(config, shard, listen, run_dir, on_listening=announce, stop=stop, curve=curve)
    except (ConfigError, TransportError, CurveError) as exc:
        _fail(str(exc))
    signalled.exit_if_caught()


@app.command()
@_config_options(own=("out", "threads"), envvars={"advertise": ADVERTISE_ENV})
def join(
    address: str = typer.Argument(..., help="Address of any member, e.g. tcp://10.0.0.5:5555."),
    listen: str = typer.Option("tcp://127.0.0.1:0", help="Address to bind (port 0: any free)."),
    rank: int | None = typer.Option(None, help="Peer id to ask for \\[default: next free]."),
    out: str | None = typer.Option(
        None, help="Run directory \\[default: runs/<timestamp>].", rich_help_panel=OUTPUT
    ),
    threads: int | None = typer.Option(
        None, help="torch threads \\[default: torch's choice].", rich_help_panel=SWARM
    ),
    timeout: float = typer.Option(30.0, help="Seconds to wait for the member to answer."),
    config_file: Path | None = typer.Option(
        None,
        "--config",
        help="Your own TOML file: its keys (and flags) win over the swarm's. A plug-in "
        "(module:function) or edge file the swarm names runs only if you name it too.",
    ),
    secure: bool = typer.Option(False, help="CURVE: encrypt, and admit only --allow's keys."),
    keys: Path | None = typer.Option(None, help="--secure: directory with this peer's key pair."),
    allow: Path | None = typer.Option(None, help="--secure: file of allowed public keys."),
    *,
    overrides: dict[str, Any],
) -> None:
    """Join a running swarm: fetch its config, take a neighbour's model, train.

    The swarm's config may name only gossipdl's built-in parts; this machine's own settings
    (run directory, device, limits, --advertise) come from --config, flags or the defaults,
    never from the swarm.
    """
    from gossipdl.peers.bootstrap import fetch_swarm_info
    from gossipdl.peers.peer import PeerError
    from gossipdl.transport import TransportError
    from gossipdl.transport.addresses import ResolveError, resolve
    from gossipdl.trust import config_from_peer

    _setup_logging(rich=False)
    try:
        _check_addresses(listen, {"ADDRESS": address})
        address = resolve(address, "ADDRESS")  # once: the join that follows dials the same IP
        curve = _curve(secure, keys, allow)
        local = {**(read_config_file(config_file) if config_file is not None else {}), **overrides}
        advertise = str(local.get("advertise") or "") or None
        _check_answerable(listen, advertise, {"ADDRESS": address})
        info = fetch_swarm_info(
            address, listen=listen, timeout=timeout, curve=curve, advertise=advertise
        )
        config = config_from_peer(info["config"], address, local)
    except (PeerError, ConfigError, CurveError, TransportError, ResolveError) as exc:
        _fail(str(exc))
    if curve is not None:  # the join that follows asks the member whose key we found
        curve = curve.knowing(address, info["key"])
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
