"""The built-in training loop behind ``gossipdl peer``: data, model, Peer, metrics, checkpoint.

Users with their own loop use ``Peer`` directly; this module is that same loop
for the datasets and models gossipdl ships, writing the run directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from gossipdl.averaging.local_optimizer import LocalOptimizer
from gossipdl.conditions import DeviceProfile, device_of
from gossipdl.config import (
    FIELDS,
    Config,
    ConfigError,
    from_dict,
    read_config_file,
    resolved,
    to_dict,
    to_toml,
)
from gossipdl.coordinator.cuda_ipc import CudaIpcError
from gossipdl.coordinator.ring import RingError
from gossipdl.coordinator.server import serve
from gossipdl.coordinator.shared_reduce import SharedReduceError
from gossipdl.coordinator.worker import ServerWorker
from gossipdl.data import Dataset, evaluation_inputs
from gossipdl.peers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from gossipdl.peers.device import pick_device
from gossipdl.peers.membership import Member
from gossipdl.peers.peer import Peer, PeerError
from gossipdl.peers.sinks import MetricsSinks, check_sinks, refuse_used_sink_files
from gossipdl.rundir import RUN_START_ENV, RunDir, write_json_atomic, write_text_atomic
from gossipdl.training import (
    AWAY_POLL_S,
    byzantine_of,
    carried_from,
    carry_on,
    dataset_of,
    drift_of,
    drifted,
    evaluation,
    initial_model,
    json_line,
    local_gradients,
    make_optimizer,
    metrics_line,
    own_test,
    peer_sampler,
    ps_worker_settings,
    save_atomic,
    shard_server,
)
from gossipdl.transport.curve import Curve
from gossipdl.transport.probe import CONNECT_WAIT_S
from gossipdl.trust import LOCAL_KEYS

log = logging.getLogger(__name__)
RING_FAILURES = (RingError, SharedReduceError, CudaIpcError)  # a ring all-reduce that failed
RING_STOP_GRACE_S = 2.0
"""How long a ring peer whose all-reduce failed waits for a stop signal of its own before it
reports the failure: Ctrl-C reaches every peer of a ``gossipdl run`` a moment apart, and one
that stopped a step sooner left the others' all-reduce; they stop in order too (evaluate,
save), as the README promises, instead of failing without their final line and model."""


def run_start() -> float | None:
    """The unix time the launcher started this run (``RUN_START_ENV``), if it says one."""
    value = os.environ.get(RUN_START_ENV)
    try:
        start = float(value) if value else None
    except ValueError:
        raise PeerError(
            f"{RUN_START_ENV}={value!r} is not a unix time; unset it or give seconds"
        ) from None
    return start if start is None or math.isfinite(start) else None


def prepare_run_dir(run: RunDir, config: Config, peer_id: int | None, *, resume: bool) -> None:
    """Create ``run`` for one peer, with the swarm's resolved config in ``config.toml`` unless
    another peer of the swarm wrote it first. Peers of one swarm may share a directory (each
    writes ``peers/<id>.jsonl``), but not with another run: ConfigError. ``resume``: the
    peer carries on in its own run, with the settings that run was started with."""
    _refuse_other_settings(run, config, resume=resume)
    if not resume and peer_id is not None:
        refuse_earlier_life(run, peer_id)
        refuse_used_sink_files(config, peer_id)
    run.create()
    if not run.config.exists():  # atomic: the peers of a torchrun job read it as they start
        write_text_atomic(run.config, to_toml(resolved(config.replace(out=str(run.root)))))


def refuse_earlier_life(run: RunDir, peer_id: int) -> None:
    """ConfigError if ``run`` already holds metrics of ``peer_id`` (a run before this one):
    a new life would be mixed into them; only ``--resume`` carries on in them."""
    if run.metrics(peer_id).exists():
        raise ConfigError(
            f"{run.root} already holds a run with a peer {peer_id} ({run.metrics(peer_id)}): "
            f"its metrics would be mixed with this one's; choose another --out, or give "
            f"--resume {run.root} --rank {peer_id} to carry that peer on from its checkpoint"
        )


def _refuse_other_settings(run: RunDir, config: Config, *, resume: bool = False) -> None:
    """ConfigError if ``run``'s ``config.toml`` records another swarm: settings other than
    ``config``'s, each peer's own (:func:`_swarm_settings`) aside. A resumed peer with other
    settings (a flag given beside ``--resume``) would train alone: the swarm refuses its
    messages, and its checkpoint's optimizer settings would override the flags anyway."""
    if not run.config.is_file():
        return
    try:
        values = read_config_file(run.config, known_keys=False)
        recorded = _swarm_settings(from_dict({k: v for k, v in values.items() if k in FIELDS}))
    except ConfigError as exc:
        raise ConfigError(
            f"{run.root} holds a config.toml that is not a run's ({exc}); choose another --out"
        ) from None
    ours = _swarm_settings(config)
    differ = [k for k in ours if ours[k] != recorded[k]]
    if differ:
        shown = "; ".join(f"{k} = {recorded[k]!r} there, {ours[k]!r} here" for k in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        if resume:
            raise ConfigError(
                f"--resume {run.root} carries its peer on with the settings the run started "
                f"with, and these differ ({shown}{more}); drop the flags, --set or --config "
                "that change them"
            )
        raise ConfigError(
            f"{run.root} already holds another run ({shown}{more}): its metrics would be mixed "
            "with this one's; choose another --out (the peers of one swarm may share one)"
        )


def _swarm_settings(config: Config) -> dict[str, Any]:
    """What makes two peers' configs one swarm's: every key as it runs, but this machine's
    and how long this peer waits for the others to start."""
    own = LOCAL_KEYS | {"startup_timeout"}
    return {k: v for k, v in to_dict(resolved(config)).items() if k not in own}


def train_peer(
    config: Config,
    run: RunDir,
    *,
    rank: int | None,
    listen: str,
    bootstrap: str | None = None,
    local_index: int = 0,
    stop: threading.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    on_training: Callable[[], None] | None = None,
    servers: list[str] | None = None,
    resume: bool = False,
    curve: Curve | None = None,
    connect_wait: float = CONNECT_WAIT_S,
) -> dict[str, Any]:
    """Train one peer (a ps worker: with ``servers``) until ``config.steps`` steps or ``stop``;
    returns its final record. ``resume``: carry this rank of ``run`` on, from its checkpoint
    (or, with metrics but no checkpoint, as a newcomer under its id), rejoining the swarm
    through ``bootstrap`` (gossip mode). ``on_listening`` gets the address
    once bound; ``on_training`` is called once the swarm has formed and training begins.
    ``connect_wait``: how long to keep trying a bootstrap address where nothing listens (a
    launcher that starts every rank at once passes its start-up timeout)."""
    with contextlib.ExitStack() as held:  # the lock of our id (RunDir.hold), to the end
        stop = stop or threading.Event()
        check_sinks(config)
        device = pick_device(config.device, local_index)
        if device.type == "cuda":  # this process's default GPU: streams, caches, kernels go there
            torch.cuda.set_device(device)
        dataset = dataset_of(config)
        model = initial_model(config, dataset).to(device)
        optimizer = make_optimizer(config, model)
        single = config.mode == "single"
        resume_step = None
        if resume:
            if config.mode != "gossip" or rank is None or bootstrap is None:
                raise PeerError(
                    "resume works for a gossip peer with a rank and a member to rejoin through; "
                    f"got mode {config.mode!r}, rank {rank}, bootstrap {bootstrap}"
                )
            held.enter_context(run.hold(rank))  # a rank still running: refused before it joins
            if run.checkpoint(rank).is_file() or not run.metrics(rank).is_file():
                try:
                    last = run.last_record(rank) or {}
                    resume_step = load_checkpoint(
                        run.checkpoint(rank), model, optimizer, peer=rank, swarm=last.get("swarm")
                    )
                except CheckpointError as exc:
                    raise PeerError(str(exc)) from None
            else:  # as the simulator restarts such a peer
                log.warning(
                    "peer %d: no checkpoint in %s (it was killed before its first); it rejoins as "
                    "a newcomer under its id and takes a neighbour's model",
                    rank,
                    run.root,
                )

        def write_members(members: list[Member]) -> None:
            run.write_members((m.id, m.address) for m in members)

        peer: Peer | ServerWorker
        if config.mode == "ps":
            peer = _server_worker(config, dataset, model, optimizer, rank, listen, servers, curve)
            if on_listening is not None:
                on_listening(peer.address)
        else:
            peer = Peer(
                model,
                optimizer,
                rank=rank,
                listen=listen,
                bootstrap=bootstrap,
                topology=config.topology,
                algorithm="allreduce" if config.mode == "ring" else config.algorithm,
                codec=config.codec,
                trigger=config.trigger,
                gamma=(config.gamma or None) if config.mode == "gossip" else None,
                defence=config.defence,
                evict_after=config.evict_after,
                attack=byzantine_of(config, rank),
                loss=config.loss,
                min_peers=1 if single else config.peers,
                seed=config.seed,
                round_timeout=config.round_timeout,
                startup_timeout=config.startup_timeout,
                max_message_bytes=int(config.max_message_mb * 2**20),
                max_message_rate=config.max_message_rate,
                heartbeat=config.heartbeat,
                dead_after=config.dead_after,
                resume_step=resume_step,
                restarted=resume,
                curve=curve,
                link=_device(config, rank).link,
                swarm_config=to_dict(config),
                on_members=write_members,
                on_listening=on_listening,
                max_members=config.max_members,
                forget_after=config.forget_after,
                max_queued_bytes=int(config.max_queued_mb * 2**20),
                advertise=config.advertise or None,
                swarm_start=run_start(),
                connect_wait=connect_wait,
                overlap=config.overlap,
                shared_memory=config.shared_memory,
            )
        if on_training is not None:
            on_training()
        try:
            resumed = resume_step is not None
            result = _loop(
                config, run, peer, dataset, device, stop, held, restarted=resume, resumed=resumed
            )
        except BaseException as exc:
            peer.close(reason=f"stopped by {type(exc).__name__}: {exc}")
            raise
        peer.close()
        return result


def _server_worker(
    config: Config,
    dataset: Dataset,
    model: torch.nn.Module,
    optimizer: LocalOptimizer,
    rank: int | None,
    listen: str,
    servers: list[str] | None,
    curve: Curve | None,
) -> ServerWorker:
    """A worker of the parameter server at ``servers`` (one address per shard)."""
    if rank is None or not servers or len(servers) != config.ps_shards:
        raise PeerError(
            f"a ps worker needs --rank and --servers with {config.ps_shards} address(es) "
            f"(ps_shards); got rank {rank}, servers {servers}"
        )
    return ServerWorker(
        model,
        optimizer,
        rank=rank,
        servers=servers,
        **asdict(ps_worker_settings(config, dataset, rank)),
        listen=listen,
        max_message_bytes=int(config.max_message_mb * 2**20),
        link=_device(config, rank).link,
        curve=curve,
        advertise=config.advertise or None,
    )


def _swarm(peer: Peer | ServerWorker) -> tuple[str, float]:
    """The swarm's id and start time (unix): a gossip swarm's agreed ones; a parameter
    server's run is named by its shards' addresses and timed from the launch (or now)."""
    if isinstance(peer, Peer):
        return peer.swarm_id, peer.swarm_start
    named = hashlib.sha256(",".join(peer.servers).encode()).hexdigest()[:16]
    return named, run_start() or time.time()


def _device(config: Config, peer_id: int | None) -> DeviceProfile:
    """The emulated device of peer ``peer_id`` (link, slowdown, step time): its profile,
    else the swarm-wide ``link`` and ``slowdown``."""
    return device_of(peer_id, config.peers, config.profiles, config.link, config.slowdown)


def run_shard(
    config: Config,
    shard: int,
    listen: str,
    run: RunDir,
    *,
    on_listening: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
    curve: Curve | None = None,
) -> dict[str, Any]:
    """Serve parameter-server shard ``shard`` until every worker left; its counters go to
    ``servers/<shard>.json`` (rewritten about once a second and at the end)."""
    server = shard_server(config, dataset_of(config), shard)
    path = run.server_stats(shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = run_start() or time.time()  # one clock with the workers the launcher started
    written: dict[int, str] = {}

    def save(stats: dict[str, Any]) -> None:
        write_json_atomic(path, {**stats, "time": round(time.time() - start, 3)})
        workers = {w: state.address for w, state in server.known.items()}
        if shard == 0 and workers != written:  # every worker talks to every shard: one writes
            run.write_members(workers.items())
            written.clear()
            written.update(workers)

    stop = stop or threading.Event()
    size, shards = server.x.numel(), config.ps_shards
    log.info("shard %d of %d: %d parameters, rule %s", shard, shards, size, config.ps)
    return serve(
        server,
        listen,
        max_message_bytes=int(config.max_message_mb * 2**20),
        max_message_rate=config.max_message_rate,
        on_listening=on_listening,
        should_stop=stop.is_set,
        report=save,
        curve=curve,
    )


def _loop(
    config: Config,
    run: RunDir,
    peer: Peer | ServerWorker,
    dataset: Dataset,
    device: torch.device,
    stop: threading.Event,
    held: contextlib.ExitStack,
    *,
    restarted: bool = False,
    resumed: bool = False,
) -> dict[str, Any]:
    """Train ``peer`` to the end, writing its metrics. ``restarted``: a new life of a peer
    of ``run`` (its lines go on in its file, its lock in ``held`` already); ``resumed``: from
    its checkpoint, with the counters of its last life carried on (a life without one starts
    them at 0). ``held`` keeps the lock of the peer's id to the caller's end."""
    model = peer.model
    assert peer.optimizer is not None
    optimizer = peer.optimizer
    sampler = peer_sampler(config, dataset, peer.id, peer.steps, device)
    x_test = evaluation_inputs(dataset, device)
    y_test = torch.as_tensor(dataset.y_test, device=device)
    own_indices = own_test(config, dataset, peer.id)
    own = None if own_indices is None else torch.as_tensor(own_indices, device=device)
    emulated = _device(config, peer.id)
    drift = drift_of(config, peer.id)
    if not restarted:  # an id the swarm gave us: unknown before it formed
        refuse_earlier_life(run, peer.id)
        refuse_used_sink_files(config, peer.id)
        held.enter_context(run.hold(peer.id))  # before its metrics file is appended to
    previous = run.last_record(peer.id) if restarted else None
    sinks = MetricsSinks(config, run, peer.id)  # first: a sink that fails leaves no file open
    metrics = run.append_metrics(peer.id)
    swarm, start = _swarm(peer)
    carried = carried_from(previous) if resumed else {}
    losses: list[torch.Tensor] = []  # read (one host sync) only when a line is written
    log.info(
        "peer %d: training on %d samples, %s, from step %d%s",
        peer.id,
        len(sampler.y),
        device,
        peer.steps,
        _emulation(emulated),
    )

    def record(**extra: Any) -> dict[str, Any]:
        stats = carry_on(peer.stats(), carried)
        now = time.time()
        means = torch.stack(losses).tolist() if losses else []
        line = metrics_line(peer.id, peer.steps, now - start, now, means, stats, extra)
        metrics.write(json_line(line))
        sinks.write(line)
        losses.clear()
        return line

    def follow_drift() -> None:
        """Permute the labels once, at the drift step; a life that starts past it (resumed, a
        late joiner) at once, before its first line is evaluated on the old labels."""
        nonlocal drift, y_test
        if drift is not None and peer.steps >= drift.step:
            y_test = drifted(config, dataset, sampler, y_test)
            log.info("peer %d: labels permuted at step %d (drift)", peer.id, peer.steps)
            drift = None

    peer.sync_at_step(config.steps)  # dynamic trigger: the swarm ends on an agreed model
    try:
        first = {"start": True, "swarm": swarm, "swarm_start": round(start, 3), "pid": os.getpid()}
        if previous is not None:  # the gap while this peer was down shows in its time
            down = time.time() - start - previous.get("time", 0.0)
            first.update(resumed=resumed, down_s=round(max(0.0, down), 3))
        follow_drift()
        record(**evaluation(model, x_test, y_test, own), **first)
        while not _finished(config, peer) and not stop.is_set():
            if not peer.transport.online:  # the device is away (churn): no steps, no traffic
                stop.wait(AWAY_POLL_S)
                record()
                continue
            follow_drift()
            computed = time.monotonic()
            loss = local_gradients(config, model, optimizer, sampler, peer.steps)
            _take_as_long(emulated, computed)
            try:
                peer.step()
            except RING_FAILURES:
                if not stop.wait(RING_STOP_GRACE_S):  # a member died or stalled: the error
                    raise
                break  # a member stopped a step sooner on the same Ctrl-C: so do we, in order
            losses.append(loss.detach())
            if config.checkpoint_every and peer.steps % config.checkpoint_every == 0:
                _settle(peer)
                save_checkpoint(
                    run.checkpoint(peer.id), model, optimizer, peer.steps, peer=peer.id, swarm=swarm
                )
            due = config.eval_every and peer.steps % config.eval_every == 0
            if due and peer.steps < config.steps:
                _settle(peer)
                record(**evaluation(model, x_test, y_test, own))
            elif peer.steps % config.log_every == 0:
                record()
        _settle(peer)
        evaluated = evaluation(model, x_test, y_test, own)
        save_atomic(model.state_dict(), run.model(peer.id))
        peer.transport.flush()  # the final line counts the last messages sent, too
        final = record(
            **evaluated,
            final=True,
            stopped_early=peer.steps < config.steps,
            device=str(device),
        )
    finally:
        metrics.close()
        sinks.close()
    log.info("peer %d: done at step %d, test accuracy %.4f", peer.id, peer.steps, final["accuracy"])
    return final


def _emulation(device: DeviceProfile) -> str:
    """How the peer's compute is slowed, for its first log line ("" when it is not)."""
    slower = f", {device.slowdown:g}x slower" if device.slowdown > 1 else ""
    least = f", at least {device.step_time:g} s a step" if device.step_time else ""
    return slower + least


def _take_as_long(device: DeviceProfile, started: float) -> None:
    """Make the step begun at ``started`` (monotonic) last as a slower device's would: a
    straggler's ``slowdown`` times as long, and at least the profile's ``step_time``."""
    took = time.monotonic() - started
    wait = max((device.slowdown - 1) * took, device.step_time - took)
    if wait > 0:
        time.sleep(wait)


def _settle(peer: Peer | ServerWorker) -> None:
    """Before the model is evaluated or saved: a gossip peer takes the round it runs in the
    background (``overlap``)."""
    if isinstance(peer, Peer):
        peer.settle()


def _finished(config: Config, peer: Peer | ServerWorker) -> bool:
    """A FedAvg worker runs until the server's last round; everyone else for ``steps``."""
    if isinstance(peer, ServerWorker):
        return peer.core.finished(config.steps)
    return peer.steps >= config.steps
