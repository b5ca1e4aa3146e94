"""Shared output for the benchmark scripts: one rich table on the console, the same rows as JSON.

Every script describes its table as a list of :class:`Column` and hands rows
(plain dicts of raw numbers, keyed by ``Column.key``) plus a ``meta`` dict to
:func:`report`. With ``--json FILE`` the file holds::

    {
      "benchmark": "transport",        # the script's name
      "rows": [{...}, ...],             # one object per table row, raw (unformatted) values
      "meta": {...},                    # settings, environment, derived results (ratios, targets)
    }

Numbers in the JSON are the unrounded values; the table only formats them.

Bad arguments are usage errors (exit 2, naming the option) before any run starts:
:func:`at_least` and :func:`peer_counts` check numbers as they are parsed, ``--json`` is
checked then too, :func:`usage_errors` turns a config no run could take into one, and
:func:`check_device` a device this machine lacks.

Every script ends with ``run_script(main)``: SIGINT (Ctrl-C) or SIGTERM stops the
whole benchmark, with the processes it started, and exits with 128 + the signal
(130 or 143) after one line on stderr; the next setting never starts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gossipdl.cli import use_huge_pages
from gossipdl.config import Config, ConfigError
from gossipdl.experiments import forking
from gossipdl.experiments.launcher import Interrupted
from gossipdl.peers.device import pick_device
from gossipdl.rundir import RunDir, dumps, write_text_atomic
from gossipdl.training import dataset_of, initial_model

T = TypeVar("T")

use_huge_pages()  # as gossipdl's commands run (before a large tensor)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class Column:
    """One table column: the row key it shows, its header, and how to format a value."""

    key: str
    header: str
    fmt: str | Callable[[Any], str] = "{}"

    def render(self, value: Any) -> str:
        if value is None:
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(value)


def run_script(main: Callable[[], None]) -> None:
    """Run a script's ``main``; SIGINT or SIGTERM unwinds it (``finally`` blocks and
    :func:`~gossipdl.experiments.launcher.launch` stop what it started), then one line
    says so and the exit code is 128 + the signal."""

    def interrupt(signum: int, frame: object) -> None:
        _ignore_stop_signals()  # a second Ctrl-C must not cut the clean-up short
        raise Interrupted(signum)

    for signum in _STOP_SIGNALS:
        signal.signal(signum, interrupt)
    try:
        main()
    except Interrupted as exc:
        _ignore_stop_signals()
        print(
            f"{Path(sys.argv[0]).name}: interrupted by {signal.Signals(exc.signum).name}; "
            f"stopped it and every process it started (exit code {exc.exit_code})",
            file=sys.stderr,
        )
        raise SystemExit(exc.exit_code) from None


def _ignore_stop_signals() -> None:
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def start_worker(process: BaseProcess) -> None:
    """Start a script's worker process with SIGINT blocked for its whole life (it inherits
    the mask): Ctrl-C, which a terminal sends to the whole process group, then stops only
    the script, whose clean-up stops its workers, and no worker prints a traceback. A stop
    signal that comes while the worker starts is acted on once it has started."""
    # The mask is per thread and another thread of this process may take the signal, whose
    # handler would then stop start() halfway: stand-in handlers hold it meanwhile.
    held: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in _STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if held:
        signal.raise_signal(held[0])


def benchmark_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of its docstring as the description, ``--quick``
    (``quick`` says what the run shrinks to) and ``--json FILE`` (checked as it is parsed:
    see :func:`json_file`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--json",
        metavar="FILE",
        type=json_file,
        default=None,
        help='also write {"benchmark", "rows", "meta"} as JSON to FILE (missing parent '
        "directories are created)",
    )
    return parser


def json_file(value: str) -> Path:
    """``--json``'s FILE, refused before the run rather than after it: not a directory, and
    its nearest existing parent a directory this process may write into (:func:`report`
    creates the missing ones under it, then writes FILE)."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; give a file name in it")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{value}: {parent} is a file, not a directory; pick another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value}: cannot write in {parent}; pick another path")
    return path


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number ``>= minimum`` (a count where fewer means nothing)."""

    def whole(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = minimum - 1
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{value!r}: give a whole number >= {minimum}")
        return number

    return whole


def peer_counts(value: str) -> list[int]:
    """An argparse type: comma-separated counts of peers or processes, in the order given,
    each at least 2 (one alone has no one to talk to)."""
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated counts >= 2, e.g. 4,8,16")
    return counts


@contextlib.contextmanager
def usage_errors(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    flags: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """Build the runs' configs (or check other specs) inside: a ``ValueError`` there (a
    ``ConfigError`` names its config key) becomes a usage error naming the option that set
    the value (exit 2), before the first run rather than a traceback after the earlier ones.
    The option is ``flags[key]``, else the one of the same name (``lr_schedule``:
    ``--lr-schedule``), else ``--config`` (the base config's value)."""
    try:
        yield
    except ValueError as exc:
        # "steps = -5; ...", "profile 'edge': step_time = 'x'; ...": the key before " = "
        said, equals, _ = str(exc).partition(" = ")
        key = said.split()[-1] if isinstance(exc, ConfigError) and equals and said else ""
        flag = (flags or {}).get(key) or (f"--{key.replace('_', '-')}" if key in vars(args) else "")
        if not flag and getattr(args, "config", None) is not None:
            flag = f"--config {args.config}"
        parser.error(f"{flag}: {exc}" if flag else str(exc))


def check_device(parser: argparse.ArgumentParser, spec: str, flag: str = "--device") -> None:
    """Refuse a device name torch does not know, or a GPU this machine lacks, as a usage
    error naming ``flag`` (``auto``: a GPU where there is one, else the CPU)."""
    import torch

    if spec != "auto":
        try:
            torch.device(spec)
        except RuntimeError:  # not a device name
            parser.error(f"{flag} {spec}: use auto, cpu, cuda[:N] or mps")
    try:
        device = pick_device(spec)
    except RuntimeError as exc:  # a GPU asked for where CUDA is not available
        parser.error(f"{flag} {spec}: {exc}")
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        parser.error(f"{flag} {spec}: this machine has {torch.cuda.device_count()} GPU(s)")


def add_swarm_options(
    parser: argparse.ArgumentParser, name: str, peers: str = "default 8", steps: str = ""
) -> None:
    """The options of a script that launches swarms: ``--peers`` (``peers``: its help),
    ``--steps`` (when ``steps`` gives its help), ``--seed``, ``--config`` (a base TOML
    config) and ``--out`` (default ``runs/bench-NAME``)."""
    parser.add_argument("--peers", type=at_least(1), default=None, help=peers)
    if steps:
        parser.add_argument("--steps", type=at_least(1), default=None, help=steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config", type=Path, default=None, help="base TOML config (lr, batch_size, ...)"
    )
    parser.add_argument("--out", type=Path, default=Path(f"runs/bench-{name}"))


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--engine``: ``real`` (the default: every swarm as local processes, the numbers
    the benchmark is for) or ``sim`` (the simulator, ``gossipdl simulate``: virtual peers on
    virtual time in this process, its times simulated seconds; a fast smoke run of the
    script, not a measurement)."""
    parser.add_argument(
        "--engine",
        choices=("real", "sim"),
        default="real",
        help="real: local processes (default); sim: the simulator, a fast smoke run",
    )


def run_swarm(
    config: Any, engine: str, until: Callable[[Any], bool] | None = None, **launch_options: Any
) -> dict[str, Any]:
    """Run ``config``'s swarm on ``engine`` (see :func:`add_engine_option`) until it ends
    or ``until(run_dir)`` says so; its summary. ``launch_options`` go to the real launch."""
    if engine == "sim":
        from gossipdl.experiments.simulated import simulate

        return simulate(config, until=until)
    from gossipdl.experiments.launcher import launch

    return launch(config, **{"progress": False, **launch_options}, until=until)


def _numbered(worker: Callable[[Any], T], item: tuple[int, Any]) -> tuple[int, T]:
    index, task = item
    return index, worker(task)


def _in_pool(numbered: Callable[[Any], T], item: Any) -> T:
    """``numbered(item)`` in a pool worker. One stopped by this process (``pool.terminate``'s
    SIGTERM, which a simulation turns into an orderly stop and ``Interrupted``) exits with
    128 + the signal, quietly: a pool prints the traceback of any other BaseException."""
    try:
        return numbered(item)
    except KeyboardInterrupt as exc:
        raise SystemExit(getattr(exc, "exit_code", 130)) from None


def run_tasks(
    worker: Callable[[Any], T], tasks: Sequence[Any], jobs: int, describe: Callable[[T], str]
) -> list[T]:
    """``worker(task)`` for every task, in the tasks' order, ``jobs`` at a time (forked from
    the preloaded server: a worker starts without importing torch), with a progress bar
    that names each finished one by ``describe``. The workers ignore Ctrl-C: this process
    stops them, as :func:`run_script` unwinds."""
    results: list[T | None] = [None] * len(tasks)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    numbered = functools.partial(_numbered, worker)
    pool = None
    with Progress(*columns, console=Console(stderr=True)) as progress:
        bar = progress.add_task(f"{len(tasks)} runs, {jobs} at a time", total=len(tasks))
        if jobs == 1:
            done: Iterator[tuple[int, T]] = map(numbered, enumerate(tasks))
        else:
            pool = forking.context().Pool(
                jobs, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
            )
            quiet = functools.partial(_in_pool, numbered)
            done = pool.imap_unordered(quiet, enumerate(tasks), chunksize=1)
        try:
            for index, result in done:
                results[index] = result
                progress.update(bar, advance=1, description=describe(result))
        finally:
            if pool is not None:
                pool.terminate()
    return [result for result in results if result is not None]


def add_only_option(parser: argparse.ArgumentParser, known: Sequence[str]) -> None:
    """Add ``--only A,B``: the settings to run (``args.only``, in table order; default all).
    An unknown name is a usage error that lists the known ones."""

    def subset(value: str) -> list[str]:
        keys = value.split(",")
        unknown = sorted(set(keys) - set(known))
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown settings {unknown}; known: {', '.join(known)}"
            )
        return [k for k in known if k in keys]

    parser.add_argument(
        "--only", type=subset, default=list(known), help="comma-separated: " + ",".join(known)
    )


def fresh_run_dir(run_dir: Path) -> None:
    """Remove a previous run directory there (a launch refuses a directory that holds a run)."""
    if run_dir.exists():
        if not (run_dir / "config.toml").is_file():
            raise SystemExit(f"{run_dir} exists and is not a gossipdl run directory; pick --out")
        shutil.rmtree(run_dir)


def step_time(run: RunDir, peers: int, warm_up: int) -> float:
    """Seconds per step, averaged over the peers, between each one's first metrics line
    after ``warm_up`` steps and its last line before the final one."""
    times = []
    for i in range(peers):
        lines = [
            r
            for r in run.records(i)
            if r["step"] >= warm_up and not r.get("final") and not r.get("start")
        ]
        if len(lines) < 2 or lines[-1]["step"] == lines[0]["step"]:
            raise SystemExit(f"peer {i} of {run.root} wrote too few lines; raise --steps")
        times.append(
            (lines[-1]["time"] - lines[0]["time"]) / (lines[-1]["step"] - lines[0]["step"])
        )
    return statistics.mean(times)


def parameters(config: Config) -> int:
    """The model's parameter count."""
    model = initial_model(config, dataset_of(config))
    return sum(p.numel() for p in model.parameters())


def environment() -> dict[str, Any]:
    """Where the numbers were taken: enough to tell two machines apart."""
    import numpy
    import torch
    import zmq

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }


def fill_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> None:
    """Each option ``name`` left out (None) takes ``defaults[name]``'s first value under
    ``--quick``, else its second; a value given, 0 included, stays."""
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def mark(met: bool | None) -> str:
    """A target's verdict as the tables print it: met, missed, or not run (None)."""
    if met is None:
        return "not run"
    return "[green]met[/]" if met else "[red]missed[/]"


def report(
    benchmark: str,
    title: str,
    columns: Sequence[Column],
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    json_path: Path | None = None,
    *,
    notes: Sequence[str] = (),
    console: Console | None = None,
    json_rows: list[dict[str, Any]] | None = None,
) -> None:
    """Print ``rows`` as a table (plus ``notes`` under it) and write them to ``json_path``
    (or ``json_rows`` instead, when the JSON has other rows than the table)."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
            console = Console(width=160)
    table = Table(title=title)
    for col in columns:
        table.add_column(col.header, justify="left" if col is columns[0] else "right")
    for row in rows:
        table.add_row(*(col.render(row.get(col.key)) for col in columns))
    console.print(table)
    for note in notes:
        console.print(note)
    if json_path is not None:
        document = {
            "benchmark": benchmark,
            "rows": rows if json_rows is None else json_rows,
            "meta": {**meta, "env": environment()},
        }
        write_atomically(json_path, dumps(document, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (:func:`write_text_atomic`), creating
    missing parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
