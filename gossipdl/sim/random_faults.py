"""Random fault schedules for the fault search: one small swarm and its faults per seed.

:func:`random_case` draws, from a seed alone, a gossip swarm small and quick
enough to run thousands of (3–12 peers, a logistic model on the synthetic
blobs, 50–120 steps in 8–16 s of virtual time, a ring, an exponential or a complete graph,
dense gossip, CHOCO, BEER or PowerGossip, every step, periodic or dynamic rounds, with or
without checkpoints, rounds behind the next step's compute or not, dense gossip sometimes
defended by BALANCE with eviction on, and then on iid or Dirichlet shards, CHOCO and BEER
sometimes by clipping or BALANCE over their public copies) and a schedule
of faults
in config form (``[[faults]]`` tables, so a case is an ordinary config that
``gossipdl simulate`` runs too). The faults
come in episodes:

* ``crash``: kill -9 of one or two peers, some restarted later (from their
  checkpoint when the swarm keeps them), two restarts at one instant (joins
  racing each other) or at the instant another peer dies (a join racing a death);
* ``partition``: the swarm splits in two or three groups, then heals;
* ``clogs``: links clogged one at a time, then unclogged in random order;
* ``leave``: a peer leaves gracefully during a round's sync, for good;

and, overlapping them, windows of message loss, duplication and reordering delay
(``inject``) and of a peer's clock running slow (``clock``). Every episode ends
(heals, unclogs, restarts) by :attr:`Case.quiet_at`; the swarm then has time to
settle before any peer can finish, which the agreement invariant needs
(:mod:`gossipdl.sim.invariants`). Restarts happen only while no partition is on, so a
restarted peer can always reach a member.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from gossipdl.averaging.triggers import parse_trigger
from gossipdl.config import Config

PEERS = (3, 12)  # swarm sizes drawn from (small ones more often: they are cheaper)
STEPS = (50, 120)  # local steps per peer (one round each, or one per period)
HORIZON_S = (8.0, 16.0)  # virtual seconds the steps take, fault-free
TOPOLOGIES = ("ring", "exponential", "complete")
ROUNDS = (("dense", "none"), ("choco", "topk:0.1"), ("choco", "qsgd:16"))  # algorithm, codec
LATER_ROUNDS = (("beer", "topk:0.1"), ("powergossip", "powersgd:1"))  # since they were added
LATER_SHARE = 0.3  # of the cases whose trigger allows them (not dynamic)
EVICTING_SHARE = 0.5  # of the dense gossip cases: BALANCE with eviction (no peer lies)
DEFENDED_SHARE = 0.3  # of the CHOCO and BEER cases: a defence over the public copies
DEFENDED = ("clip", "balance")
SKEWED_SHARE = 0.5  # of the defended cases: Dirichlet shards (honest outliers to evict)
SKEWED = ("dirichlet:0.3", "dirichlet:0.1")
TRIGGERS = ("always", "periodic:2", "periodic:3", "dynamic:1%:2")
EPISODES = ("crash", "partition", "clogs", "leave")
SETTLE_HEARTBEATS = 6  # heartbeats after dead_after in which the live peers must agree


@dataclass(frozen=True)
class Case:
    """A seed's swarm and fault schedule, and when the faults are over."""

    seed: int
    config: Config
    quiet_at: float  # virtual time by which every fault has healed
    settle_s: float  # then the live peers agree within this many virtual seconds

    @property
    def settled_at(self) -> float:
        """When the agreement invariant is checked."""
        return self.quiet_at + self.settle_s


def random_case(seed: int, out: str = "", latency: bool = True) -> Case:
    """The swarm and the faults seed ``seed`` draws (the same for a seed on any machine);
    ``latency=False``: without the drawn link latency and jitter, as every search before
    seed 143500's ran (the seeds those found are replayed that way)."""
    rng = random.Random(seed)
    peers = PEERS[0] + min(rng.randint(0, PEERS[1] - PEERS[0]) for _ in range(3))
    steps = rng.randint(*STEPS)
    step_time = round(rng.uniform(*HORIZON_S) / steps, 3)
    heartbeat = rng.choice((0.25, 0.5))
    dead_after = heartbeat * rng.choice((4, 6))
    algorithm, codec = rng.choice(ROUNDS)
    trigger = rng.choice(TRIGGERS)
    period = 1 if trigger == "always" else int(trigger.rsplit(":", 1)[1])
    horizon = steps * step_time  # no peer finishes before
    settle_s = dead_after + SETTLE_HEARTBEATS * heartbeat
    quiet_at = round(max(1.0, 0.8 * horizon - settle_s), 3)  # on the millisecond grid of `at`
    topology = rng.choice(TOPOLOGIES[:2] if peers > 5 else TOPOLOGIES)
    round_timeout = rng.choice((0.5, 1.0))
    delay, jitter = rng.choice((2, 5, 20)), rng.choice((0, 1))
    # Every peer's link is the profile's (a profile replaces the swarm's ``link``): drawn into
    # ``link`` alone, as before seed 143500's searches, the latency never reached a peer.
    link = {"latency": f"{delay}ms", "jitter": f"{jitter}ms"} if latency else {}
    config = Config(
        peers=peers,
        topology=topology,
        algorithm=algorithm,
        codec=codec,
        trigger=trigger,
        dataset="synthetic",
        model="logistic",
        steps=steps,
        batch_size=16,
        seed=seed,
        eval_every=0,
        log_every=max(period, steps // 4 // period * period),
        round_timeout=round_timeout,
        startup_timeout=10.0,  # longer than any episode: a restart cut off by one gets in
        heartbeat=heartbeat,
        dead_after=dead_after,
        checkpoint_every=rng.choice((0, 5 * period)),
        profiles={
            "all": {"peers": f"0-{peers - 1}", "step_time": f"{step_time * 1000:g}ms", **link}
        },
        faults=_schedule(rng, peers, quiet_at),
        overlap=rng.random() < 0.5,  # drawn last: the draws before it are those of earlier
        out=out,  # searches, so a seed's swarm and faults are the same as they were
    )
    if rng.random() < LATER_SHARE and not parse_trigger(trigger).dynamic:  # drawn after all
        algorithm, codec = rng.choice(LATER_ROUNDS)  # else, for the same reason
        config = replace(config, algorithm=algorithm, codec=codec)
    if config.algorithm == "dense" and rng.random() < EVICTING_SHARE:  # drawn after those
        config = replace(config, defence="balance", evict_after=rng.choice((3, 5)))
        if rng.random() < SKEWED_SHARE:  # drawn after all else, for the same reason
            config = replace(config, partition=rng.choice(SKEWED))
    if config.algorithm in ("choco", "beer") and rng.random() < DEFENDED_SHARE:  # drawn after
        config = replace(config, defence=rng.choice(DEFENDED))  # all else (same reason)
    return Case(seed, config, quiet_at, settle_s)


def _schedule(rng: random.Random, peers: int, quiet_at: float) -> list[dict[str, Any]]:
    """Fault episodes one after another in ``[0.5 s, quiet_at]``, with loss and slow-clock
    windows over them."""
    events: list[dict[str, Any]] = []
    alive = set(range(peers))  # not killed for good, not left
    t, budget = 0.5, rng.randint(1, 4)
    for _ in range(budget):
        length = rng.uniform(0.5, 4.0)
        if t + length > quiet_at:
            break
        kind = rng.choice(EPISODES)
        if kind == "crash" and len(alive) > 2:
            _crash(rng, events, alive, t, length)
        elif kind == "partition":
            _partition(rng, events, peers, t, length)
        elif kind == "clogs":
            _clogs(rng, events, peers, t, length)
        elif kind == "leave" and len(alive) > 2:
            gone = rng.choice(sorted(alive))
            alive.discard(gone)
            events.append({"at": _s(t), "leave": str(gone)})
        t += length + rng.uniform(0.0, 2.0)
    for _ in range(rng.randint(0, 2)):  # windows over the episodes
        start = rng.uniform(0.5, quiet_at)
        end = min(quiet_at, start + rng.uniform(0.5, 5.0))
        if rng.random() < 0.5:
            inject = {
                "loss": rng.choice((0.01, 0.05, 0.2)),
                "duplicate": rng.choice((0, 0.05)),
                "reorder": rng.choice(("0ms", "20ms", "200ms")),
            }
            events += [{"at": _s(start), "inject": inject}, {"at": _s(end), "inject": {}}]
        else:
            slow = str(rng.randrange(peers))
            rate = rng.choice((0.5, 0.8, 1.25))
            events += [
                {"at": _s(start), "clock": {"peers": slow, "rate": rate}},
                {"at": _s(end), "clock": {"peers": slow, "rate": 1}},
            ]
    events.sort(key=lambda e: float(e["at"][:-1]))  # stable: an episode's order at one instant
    return events


def _crash(
    rng: random.Random, events: list[dict[str, Any]], alive: set[int], t: float, length: float
) -> None:
    """One or two peers die; each is restarted at the episode's end or stays dead. Two
    restarts share an instant, and a third peer may die at it."""
    victims = rng.sample(sorted(alive), min(rng.choice((1, 2)), len(alive) - 2))
    events.append({"at": _s(t), "kill": ",".join(map(str, victims))})
    back = [v for v in victims if rng.random() < 0.7]
    end = t + length
    if back:
        events.append({"at": _s(end), "restart": ",".join(map(str, back))})
    alive.difference_update(v for v in victims if v not in back)
    racing = sorted(alive - set(victims))
    if back and len(racing) > 2 and rng.random() < 0.3:  # a join racing a death
        dies = rng.choice(racing)
        events.append({"at": _s(end), "kill": str(dies)})
        alive.discard(dies)


def _partition(
    rng: random.Random, events: list[dict[str, Any]], peers: int, t: float, length: float
) -> None:
    """The swarm splits in two or three random groups, then heals."""
    ids = list(range(peers))
    rng.shuffle(ids)
    cuts = sorted(rng.sample(range(1, peers), min(rng.choice((1, 2)), peers - 1)))
    groups = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, peers], strict=True)]
    events.append({"at": _s(t), "partition": [",".join(map(str, sorted(g))) for g in groups]})
    events.append({"at": _s(t + length), "heal": True})


def _clogs(
    rng: random.Random, events: list[dict[str, Any]], peers: int, t: float, length: float
) -> None:
    """Links clogged one at a time, then unclogged in random order."""
    pairs = [(a, b) for a in range(peers) for b in range(peers) if a != b]
    chosen = rng.sample(pairs, min(len(pairs), rng.randint(1, 4)))
    step = length / (2 * len(chosen))
    for k, (a, b) in enumerate(chosen):
        events.append({"at": _s(t + k * step), "clog": f"{a}>{b}"})
    rng.shuffle(chosen)
    for k, (a, b) in enumerate(chosen):
        events.append({"at": _s(t + length / 2 + k * step), "unclog": f"{a}>{b}"})


def _s(seconds: float) -> str:
    """A time as a fault's ``at`` (to the millisecond, so a config written out reads back
    the same)."""
    return f"{seconds:.3f}s"
