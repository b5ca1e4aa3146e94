"""Joining on the simulated engine: a virtual peer asks to be let in (back in) and aligns
with a neighbour, as the real ``Peer`` does, with its requests and retries on the virtual
clock.

Two things start a join: a member's table says the peer was dropped (it was declared
dead across a partition or an offline window; the protocol core sets ``rejoin_via``),
and a ``restart`` fault (the peer died and starts again: from its last checkpoint,
keeping that model, when ``checkpoint_every`` made one; else as a newcomer that gets
its old id back and takes a neighbour's model). The member's side (who is let in, the
welcome, the announcement, the model) is the protocol core's
(:meth:`~gossipdl.protocol.core.GossipCore.answer_join`); this module is the joiner's:
``join`` to a member until a welcome comes, then ``model_request`` to each neighbour of
its first round (then any other member) until one answers, then the round it starts at.

Once let in, the peer is a member: it declares the silent dead as any member does, so a
source that died stops being asked (in ``dead_after``, not ``MODEL_WAIT_S``), and a
table that says it was dropped meanwhile sends a newcomer back to join through its
sender (a peer that keeps its model starts, then rejoins as a started one does). A peer
left with no member to align with starts at its welcome's round with the model it has:
the others died or finished, and it carries the swarm on. Nobody answering within
``MODEL_WAIT_S`` per neighbour ends a newcomer; one that keeps its model starts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipdl.protocol.core import JoinRefused
from gossipdl.protocol.joining import MODEL_WAIT_S, RETRY_S
from gossipdl.sim.clock import Timer
from gossipdl.transport.wire import Message, WireError

if TYPE_CHECKING:
    import torch

    from gossipdl.sim.engine import Simulation, VirtualPeer

MODEL_TRIES = round(MODEL_WAIT_S / RETRY_S)  # model requests to one member before the next
log = logging.getLogger(__name__)


@dataclass
class Join:
    """One join in progress: whom it asks, what it does once in, and its timers."""

    via: list[int]  # the members to ask, in order
    rejoin: bool  # a peer that trained before (its entry gets a new life)
    take_model: bool  # a newcomer takes its neighbour's model; a peer back keeps its own
    give_up_at: float  # virtual time after which the join fails
    then: Callable[[], None]  # what the peer does once it is in
    fail: Callable[[str, bool], None]  # if it cannot get in: why, and whether it was welcomed
    every: float = RETRY_S  # how long a join request waits before the next one is sent
    each: int = 1  # join requests to one member before the next is asked
    phase: str = "welcome"  # then "model"
    tries: int = 0  # requests sent in this phase
    since: int = 0  # the first round of our new life (from the welcome)
    timer: Timer | None = None


def start_join(
    simulation: Simulation,
    peer: VirtualPeer,
    via: list[int],
    *,
    rejoin: bool,
    take_model: bool,
    timeout: float,
    then: Callable[[], None],
    fail: Callable[[str, bool], None],
    every: float = RETRY_S,
    each: int = 1,
) -> None:
    """Ask the members ``via`` in turn (``each`` times, ``every`` virtual seconds apart, then
    the next) to let ``peer`` in; ``then()`` once it is aligned with the swarm,
    ``fail(why, welcomed)`` if nobody lets it in within ``timeout`` virtual seconds, or no
    neighbour sends its model once it is in (``welcomed``)."""
    now = simulation.clock.now
    peer.join = Join(via, rejoin, take_model, now + timeout, then, fail, every, each)
    _ask(simulation, peer)


def _nonce(simulation: Simulation, peer: VirtualPeer) -> str:
    """A request's nonce, drawn from the peer's seeded stream (the same every run)."""
    if peer.id not in simulation.nonces:
        simulation.nonces[peer.id] = random.Random(simulation.config.seed * 31 + peer.id)
    rng = simulation.nonces[peer.id]
    return f"{rng.getrandbits(64):016x}"


def _ask(simulation: Simulation, peer: VirtualPeer) -> None:
    """Send the request the join's phase needs (again, after ``RETRY_S``), or give up."""
    join, core, now = peer.join, peer.core, simulation.clock.now
    assert join is not None
    keeps_model = join.phase == "model" and not join.take_model
    if now >= join.give_up_at:
        if keeps_model:  # nobody answered: our welcome's round it is
            _start(simulation, peer, join.since, None)
            return
        what = "nobody let it in" if join.phase == "welcome" else "no neighbour sent its model"
        _end(simulation, peer, failed=f"peer {peer.id}: {what} within the timeout")
        return
    send = None
    if join.phase == "welcome":
        to = join.via[join.tries // join.each % len(join.via)]
        meta = {
            "address": simulation.address(peer.id),
            "want_id": peer.id,
            "key": "",
            "incarnation": peer.life + 1,  # one process per life (a real one draws it)
            **({"rejoin": True} if join.rejoin else {}),
        }
        send = core.ask("join", simulation.address(to), meta, _nonce(simulation, peer))
    elif sources := core.model_sources(join.since):  # again each time: one may have died
        member = core.membership.get(sources[join.tries // MODEL_TRIES % len(sources)])
        assert member is not None
        send = core.ask("model_request", member.address, {}, _nonce(simulation, peer))
    else:  # nobody left to align with (dead or finished): our welcome's round, our model
        if join.take_model:
            log.warning(
                "peer %d at %.3fs: no member left to take a model from; in at round %d "
                "with its own", peer.id, now, join.since,
            )  # fmt: skip
        _start(simulation, peer, join.since, None)
        return
    join.tries += 1
    if send is not None:
        simulation.network.send(peer.id, simulation.node_at(send.address), send.frames)
    wait = join.every if join.phase == "welcome" else RETRY_S
    join.timer = simulation.clock.after(wait, lambda: _retry(simulation, peer, join))


def aligning(peer: VirtualPeer) -> bool:
    """Whether the peer was let in and waits for a member's model (or round)."""
    return peer.join is not None and peer.join.phase == "model"


def dropped(simulation: Simulation, peer: VirtualPeer) -> None:
    """A member's table said the aligning peer was dropped (the core set ``rejoin_via``):
    a newcomer asks to be let in again, through the sender first; a peer that keeps its
    model starts at its welcome's round and rejoins from there as a started one does."""
    join = peer.join
    assert join is not None
    if not join.take_model:
        _start(simulation, peer, join.since, None)
        return
    _cancel(join)
    start_join(
        simulation,
        peer,
        [m.id for m in peer.core.rejoin_order()],
        rejoin=True,
        take_model=True,
        timeout=simulation.config.startup_timeout,
        then=join.then,
        fail=join.fail,
    )


def yielded(simulation: Simulation, peer: VirtualPeer) -> None:
    """The core let in a member that rejoined through it while it rejoined itself, and its
    rejoin ended (``GossipCore.yields_to``): a join asking still stops, and the peer goes on
    with its round."""
    if peer.join is not None and peer.join.phase == "welcome":
        _end(simulation, peer, failed=None)


def _retry(simulation: Simulation, peer: VirtualPeer, join: Join) -> None:
    if peer.join is join and not peer.dead:
        _ask(simulation, peer)


def answered(simulation: Simulation, peer: VirtualPeer) -> None:
    """Take the answers the peer's core kept (a welcome, a model) and move the join on."""
    core, join = peer.core, peer.join
    answers, core.answers = core.answers, []
    for msg in answers:
        if join is None or peer.join is not join:
            return
        try:
            _take(simulation, peer, join, msg)
        except WireError as exc:
            simulation.network.stats(peer.id).drop(exc.reason)


def _take(simulation: Simulation, peer: VirtualPeer, join: Join, msg: Message) -> None:
    core, now = peer.core, simulation.clock.now
    if msg.kind == "welcome" and join.phase == "welcome":
        try:
            me = core.welcomed(simulation.local(peer), msg)
        except JoinRefused as exc:
            why = f"peer {peer.id}: peer {msg.sender} refused to let it in: {exc}"
            _end(simulation, peer, failed=why)
            return
        join.phase, join.since, join.tries = "model", me.since, 0
        neighbours = len(core.neighbours(me.since))  # each asked for MODEL_WAIT_S in turn
        join.give_up_at = now + MODEL_WAIT_S * max(1, neighbours)
        simulation.welcomed(peer)
        _cancel(join)
        _ask(simulation, peer)
    elif msg.kind == "model" and join.phase == "model":
        if core.model_refused(msg) is not None:  # not in itself yet: the next member now
            join.tries = (join.tries // MODEL_TRIES + 1) * MODEL_TRIES
            _cancel(join)
            _ask(simulation, peer)
            return
        model = core.decode_model(msg) if join.take_model else None
        _start(simulation, peer, max(join.since, msg.round), model, msg.round)


def _start(
    simulation: Simulation,
    peer: VirtualPeer,
    round: int,
    model: torch.Tensor | None,
    swarm_round: int | None = None,
) -> None:
    """The join is done: the peer starts at ``round`` (with ``model``, if it takes one),
    aligned with a member at ``swarm_round`` (None if nobody answered)."""
    simulation.start_late(peer, round, model, swarm_round)
    _end(simulation, peer, failed=None)


def _cancel(join: Join) -> None:
    if join.timer is not None:
        join.timer.cancel()
        join.timer = None


def _end(simulation: Simulation, peer: VirtualPeer, failed: str | None) -> None:
    join = peer.join
    assert join is not None
    _cancel(join)
    peer.join = None
    if failed is None:
        join.then()
    else:
        join.fail(failed, join.phase == "model")


def cancel_join(peer: VirtualPeer) -> None:
    """The peer died while joining: forget the join."""
    if peer.join is not None:
        _cancel(peer.join)
        peer.join = None
