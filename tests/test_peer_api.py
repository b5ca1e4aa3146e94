"""The Peer API in-process: exact D-PSGD mixing over real sockets, partial rounds, joining."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from conftest import free_addresses, in_threads, wait_for

from gossipdl import Peer
from gossipdl.config import ConfigError, load_config
from gossipdl.coordinator import shared_reduce
from gossipdl.peers.membership import Member
from gossipdl.peers.peer import PeerError
from gossipdl.topologies import build_topology
from gossipdl.transport import encode
from gossipdl.transport.shaping import LinkProfile


def make_swarm(
    n: int,
    topology: str,
    values: list[float],
    width: int = 3,
    device: str = "cpu",
    links: dict[int, LinkProfile] | None = None,
    **kwargs: Any,
) -> list[Peer]:
    """``n`` Peers in this process, formed through peer 0; peer i's weights all equal values[i]
    (peer i's emulated link: ``links[i]``, if given)."""
    models = []
    for value in values:
        model = torch.nn.Linear(width, 2, device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        models.append(model)
    peers: list[Peer | None] = [None] * n
    founder_address: list[str] = []
    listening = threading.Event()

    def on_listening(address: str) -> None:
        founder_address.append(address)
        listening.set()

    def start(i: int) -> None:
        own = {**kwargs, **({"link": links[i]} if links and i in links else {})}
        if i == 0:
            peers[0] = Peer(
                models[0], topology=topology, min_peers=n, on_listening=on_listening, **own
            )
        else:
            listening.wait(30)
            peers[i] = Peer(
                models[i],
                rank=i,
                bootstrap=founder_address[0],
                topology=topology,
                min_peers=n,
                **own,
            )

    errors = in_threads(start, range(n))
    assert not errors, errors
    return [p for p in peers if p is not None]


def run_rounds(
    peers: list[Peer], rounds: int, before: Callable[[Peer], None] | None = None
) -> None:
    def work(peer: Peer) -> None:
        for _ in range(rounds):
            if before:
                before(peer)
            peer.gossip()

    errors = in_threads(work, peers)
    assert not errors, errors


def train_in_background(peers: list[Peer], stop: threading.Event) -> list[threading.Thread]:
    """Gossip rounds on each of ``peers``, each in its own thread, until ``stop`` is set."""

    def train(peer: Peer) -> None:
        while not stop.is_set():
            peer.gossip()

    threads = [threading.Thread(target=train, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    return threads


def value_of(peer: Peer) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in peer.model.parameters()])
    assert torch.allclose(flat, flat[0].expand_as(flat))
    return float(flat[0])


@pytest.mark.parametrize("topology", ["ring", "complete", "star"])
def test_one_round_is_exactly_w_times_x(topology: str) -> None:
    n = 5
    values = [float(i * i) for i in range(n)]
    peers = make_swarm(n, topology, values, startup_timeout=30)
    try:
        assert all(len(p.membership.active(0)) == n for p in peers)
        run_rounds(peers, 1)
        w = build_topology(topology, n).mixing_matrix()
        expected = w @ np.array(values)
        got = [value_of(p) for p in sorted(peers, key=lambda p: p.id)]
        np.testing.assert_allclose(got, expected, rtol=1e-6)
        for p in peers:
            assert p.stats()["messages_dropped"] == {}
            assert p.neighbour_misses == 0
    finally:
        for p in peers:
            p.close()


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_neighbour_gets_the_rounds_model_though_training_writes_it_at_once(codec: str) -> None:
    """Peer 0's messages leave 0.5 s late (its link) while peer 1's come at once, so peer 0
    ends its round, and writes its parameters, before its model is sent: peer 1 must
    still mix the round's model. Uncompressed, a payload is the round model's own memory,
    so the round runs on a copy of the parameters; with a codec (a payload of its own) it
    reads the live parameter vector itself. Values 0 and 10 are exact in fp16."""
    peers = make_swarm(
        2,
        "complete",
        [0.0, 10.0],
        algorithm="dense",
        codec=codec,
        links={0: LinkProfile(latency_s=0.5)},
    )
    try:
        founder = next(p for p in peers if p.id == 0)

        def work(peer: Peer) -> None:
            peer.gossip()
            if peer is founder:
                with torch.no_grad():
                    for p in peer.params:
                        p.fill_(1e6)  # the next step, before the round's model went out

        errors = in_threads(work, peers)
        assert not errors, errors
        other = next(p for p in peers if p is not founder)
        assert value_of(other) == 5.0
        assert all(p.flat_params.live() is not None for p in peers)  # still views of one vector
        assert (founder._round_model() is founder.flat_params.live()) == (codec != "none")
    finally:
        for p in peers:
            p.close()


OVERLAP_CASES = [(False, 0.25), (True, 0.3125)]


def two_steps_of_a_w(overlap: bool, device: str = "cpu") -> list[float]:
    """Two peers, every weight 1, gradients a·w with a = 1 and 3 (lr 0.25), two steps;
    the peers' weights after settle(). Without overlap each step mixes the stepped models:
    0.75, 0.25 → 0.5; 0.375, 0.125 → 0.25. With overlap the second gradient is taken at
    the model sent (0.75, 0.25: both 0.75), applied to the mix: 0.5 − 0.1875 = 0.3125."""
    peers = make_swarm(2, "ring", [1.0, 1.0], device=device, overlap=overlap)
    slopes = {0: 1.0, 1: 3.0}
    try:

        def train(peer: Peer) -> None:
            peer.optimizer = torch.optim.SGD(peer.model.parameters(), lr=0.25)
            for _ in range(2):
                for p in peer.model.parameters():
                    p.grad = slopes[peer.id] * p.detach().clone()
                peer.step()
            peer.settle()

        errors = in_threads(train, peers)
        assert not errors, errors
        return [value_of(p) for p in peers]
    finally:
        for p in peers:
            p.close()


@pytest.mark.parametrize(("overlap", "expected"), OVERLAP_CASES)
def test_overlap_takes_the_gradient_at_the_model_it_sent(overlap: bool, expected: float) -> None:
    assert two_steps_of_a_w(overlap) == [pytest.approx(expected)] * 2


def test_overlap_is_refused_where_there_is_nothing_to_overlap() -> None:
    """A walk has no round, ps no overlap, a ring that averages models or runs PowerSGD no
    gradient buckets: each refused by name, in a config and by the Peer API."""
    for changes, named in (
        ({"mode": "ps"}, "mode 'ps'"),
        ({"algorithm": "gossip-learning"}, "gossip-learning"),
        ({"mode": "ring", "trigger": "periodic:4"}, "trigger always"),
        ({"mode": "ring", "codec": "powersgd:2"}, "PowerSGD"),
    ):
        with pytest.raises(ConfigError, match=named):
            load_config(None, overlap=True, **changes)
    assert load_config(None, overlap="true", mode="ring").overlap is True
    with pytest.raises(ValueError, match="trigger always"):  # no optimizer: models averaged
        Peer(torch.nn.Linear(2, 2), algorithm="allreduce", overlap=True)


def test_a_peer_that_fails_to_start_leaves_the_model_free_to_train() -> None:
    """An overlapping ring hooks the model's gradients as the peer is built; a start that
    failed (nobody at the bootstrap address) left the hooks, and the second backward pass
    of the user's own training raised."""
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PeerError):
        Peer(model, optimizer, algorithm="allreduce", overlap=True,
             bootstrap="tcp://127.0.0.1:9", connect_wait=0.5)  # fmt: skip
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert [t.name for t in threading.enumerate() if t.name.startswith("allreduce")] == []


def train_a_ring(
    overlap: bool,
    steps: int = 2,
    device: str = "cpu",
    shared_memory: bool = False,
    slow: LinkProfile | None = None,
    rings: dict[int, list[str]] | None = None,
) -> tuple[list[torch.Tensor], list[int]]:
    """Three peers all-reduce their gradients (mode ring) over ``steps`` steps of an MLP
    with one frozen bias (peer 0's uplink ``slow``); their parameters after, and per peer
    the buckets that had gone out when the first backward ended (in ``rings``, per peer,
    the kinds of all-reduce it made)."""
    addresses = free_addresses(3)
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    template[0].bias.requires_grad_(False)
    models: dict[int, torch.nn.Module] = {}
    early: dict[int, int] = {}

    def work(rank: int) -> None:
        model = copy.deepcopy(template).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        peer = Peer(
            model, opt, rank=rank, peers=addresses, algorithm="allreduce", overlap=overlap,
            shared_memory=shared_memory, link=slow if rank == 0 else None, round_timeout=20,
        )  # fmt: skip
        with peer:
            for step in range(steps):
                x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                if step == 0 and peer._gradients is not None:
                    early[rank] = peer._gradients._sent
                peer.step()
            if rings is not None:
                rings[rank] = sorted({type(r).__name__ for r in peer._shared_rings} or {"tcp"})
        models[rank] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])

    errors = in_threads(work, range(3))
    assert not errors, errors
    return [models[r] for r in range(3)], [early.get(r, 0) for r in range(3)]


def test_a_ring_overlapping_backward_averages_the_gradients_it_would_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With overlap a ring sends its gradients in buckets of 10 values (66 in all: 7
    buckets, a parameter across two, a padded last one, a frozen bias filled in as zeros)
    while backward runs, and ends on the parameters the one-shot average gives."""
    import gossipdl.peers.peer as peer_module

    monkeypatch.setattr(peer_module, "GRADIENT_BUCKET_NUMEL", 10)
    overlapped, early = train_a_ring(overlap=True)
    whole, _ = train_a_ring(overlap=False)
    assert all(torch.equal(m, overlapped[0]) for m in overlapped)
    torch.testing.assert_close(overlapped[0], whole[0], rtol=0, atol=1e-6)
    assert min(early) >= 1  # buckets went out before step() was called


def test_a_ring_overlapping_backward_agrees_when_its_last_chunk_is_still_on_the_way() -> None:
    """A rank's all-reduce ends with the chunk it finished still queued for its successor
    (nothing it waits for needs it read); sent from the bucket buffer itself, the next
    backward's gradients went out in its place on a slow link, and ranks held different
    models (0.3 apart). It goes out as a copy."""
    slow = LinkProfile(latency_s=0.1, jitter_s=0.1)
    models, _ = train_a_ring(overlap=True, steps=6, slow=slow)
    assert all(torch.equal(m, models[0]) for m in models)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_ring_leaves_frozen_parameters_alone_and_gradients_of_their_own_dtype(
    overlap: bool,
) -> None:
    """Mode ring gave a frozen parameter a zero gradient, which weight decay then moved
    (torch leaves it alone); without overlap it made float64 gradients float32 views, and
    Adam refused them."""
    addresses = free_addresses(2)
    torch.manual_seed(0)
    template = torch.nn.Linear(4, 3).double()
    template.bias.requires_grad_(False)
    frozen = template.bias.detach().clone()
    errors = []

    def work(rank: int) -> None:
        model = copy.deepcopy(template)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        with Peer(model, opt, rank=rank, peers=addresses, algorithm="allreduce",
                  overlap=overlap) as peer:  # fmt: skip
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 4, dtype=torch.float64)).pow(2).sum().backward()
                peer.step()
        if not (torch.equal(model.bias, frozen) and model.bias.grad is None):
            errors.append(f"rank {rank}: the frozen bias moved or has a gradient")
        if model.weight.grad is None or model.weight.grad.dtype != torch.float64:
            errors.append(f"rank {rank}: the weight's gradient is not float64")

    assert not in_threads(work, range(2))
    assert not errors, errors


def test_a_failed_bucket_cancels_the_buckets_queued_behind_it() -> None:
    """With overlap, a ring that failed (a dead peer) left its other buckets queued: each
    started an all-reduce of its own and waited out the timeout again, so closing a peer
    took one round_timeout a bucket (217 s for 44)."""
    from gossipdl.coordinator.buckets import OverlappedGradients
    from gossipdl.coordinator.ring import RingError

    calls = []

    class DeadRing:
        def allreduce_mean_(self, values: torch.Tensor) -> torch.Tensor:
            calls.append(values.numel())
            time.sleep(0.05)  # the timeout it waits out
            raise RingError("nothing from peer 2 (its predecessor)")

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    buckets = OverlappedGradients(list(model.parameters()), DeadRing, bucket_numel=40)
    assert len(buckets.bounds) > 10
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RingError, match="peer 2"):
        buckets.wait()
    buckets.close()
    assert len(calls) <= 2  # the bucket that failed, and one that had already started


def test_a_parameter_that_changes_size_is_refused_by_the_overlapped_buckets() -> None:
    """The buckets lay out the sizes they started with: a parameter rebound to more values
    took its neighbour's gradient as its own, silently."""
    from gossipdl.coordinator.buckets import OverlappedGradients

    class Alone:  # a ring of one: the mean is the values
        def allreduce_mean_(self, values: torch.Tensor) -> torch.Tensor:
            return values

    model = torch.nn.Linear(4, 2)
    buckets = OverlappedGradients(list(model.parameters()), Alone, bucket_numel=4)
    model(torch.randn(3, 4)).sum().backward()
    buckets.wait()
    model.bias.data = torch.zeros(3)
    model.zero_grad()
    with pytest.raises(RuntimeError, match="parameter 1 changed size"):
        torch.nn.functional.linear(torch.randn(3, 4), model.weight).sum().backward()
        model.bias.sum().backward()
        buckets.wait()
    buckets.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_ring_through_shared_memory_averages_as_the_tcp_ring(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """shared_memory=True: the same parameters as the TCP ring (whole, or in buckets of 10
    during backward), no chunk on the wire."""
    import gossipdl.peers.peer as peer_module

    monkeypatch.setattr(peer_module, "GRADIENT_BUCKET_NUMEL", 10)
    rings: dict[int, list[str]] = {}
    shared, _ = train_a_ring(overlap=overlap, steps=3, shared_memory=True, rings=rings)
    tcp, _ = train_a_ring(overlap=False, steps=3)
    assert rings == {r: ["SharedRing"] for r in range(3)}  # not the TCP ring beside it
    assert all(torch.equal(m, shared[0]) for m in shared)
    torch.testing.assert_close(shared[0], tcp[0], rtol=0, atol=1e-6)


def test_a_shared_memory_ring_names_a_peer_that_left() -> None:
    """Peer 1 of a shared-memory ring closes after one step: the others' next step stops
    with an error naming it, well before their round timeout."""
    addresses = free_addresses(3)
    stopped: dict[int, tuple[str, float]] = {}

    def work(rank: int) -> None:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Peer(
            model, opt, rank=rank, peers=addresses, algorithm="allreduce", shared_memory=True,
            round_timeout=20.0,
        ) as peer:  # fmt: skip
            for step in range(2):
                if rank == 1 and step == 1:
                    return
                opt.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                started = time.monotonic()
                try:
                    peer.step()
                except Exception as exc:
                    stopped[rank] = (str(exc), time.monotonic() - started)
                    return

    assert not in_threads(work, range(3))
    assert sorted(stopped) == [0, 2], stopped
    for message, waited in stopped.values():
        assert "peer 1 left" in message and waited < 10.0, message


def test_shared_memory_is_refused_where_it_cannot_stand_in_for_the_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="shared_memory averages a ring all-reduce"):
        load_config(None, shared_memory="true")
    with pytest.raises(ConfigError, match="fp16 saves nothing"):
        load_config(None, shared_memory="true", mode="ring", codec="fp16")
    assert load_config(None, shared_memory="true", mode="ring").shared_memory is True
    with monkeypatch.context() as patch:  # a system without memfd (macOS, Windows)
        patch.setattr(shared_reduce, "available", lambda: False)
        with pytest.raises(ConfigError, match="shared_memory = true: shared memory needs Linux"):
            load_config(None, shared_memory="true", mode="ring")
    with pytest.raises(ValueError, match="turn it off"):
        Peer(torch.nn.Linear(2, 2), rank=0, peers=free_addresses(2), shared_memory=True)


def test_a_peer_closed_with_a_round_behind_it_stops_at_once() -> None:
    """With overlap, a peer closed while its round waits for a silent neighbour ends that
    round (the round does not wait out its 30 s timeout) and closes."""
    peers = make_swarm(2, "ring", [0.0, 2.0], overlap=True, round_timeout=30.0)
    try:
        peers[0].optimizer = torch.optim.SGD(peers[0].model.parameters(), lr=0.1)
        peers[0].step()  # its round now waits for peer 1, which never sends
        started = time.monotonic()
        peers[0].close()
        assert time.monotonic() - started < 5.0
        assert value_of(peers[0]) == 0.0  # the round's merge is never taken
    finally:
        for p in peers:
            p.close()


def test_a_silent_neighbours_weight_stays_with_each_peer() -> None:
    """x_i + Σ W_ij (x_j − x_i) over who sent: 0 + (3 − 0)/3 and 3 + (0 − 3)/3, so peers 0
    and 1 keep their sum."""
    peers = make_swarm(3, "complete", [0.0, 3.0, 30.0], round_timeout=0.5)
    try:
        run_rounds(peers[:2], 1)  # peer 2 never sends round 0
        assert value_of(peers[0]) == pytest.approx(1.0) and value_of(peers[1]) == pytest.approx(2.0)
        assert peers[0].neighbour_misses == 1 and peers[1].neighbour_misses == 1
    finally:
        for p in peers:
            p.close()


def test_a_peer_that_left_is_not_waited_for() -> None:
    peers = make_swarm(3, "complete", [0.0, 3.0, 30.0], round_timeout=60)
    try:
        peers[2].close()  # announces that it stopped
        finished = threading.Event()

        def two_rounds() -> None:
            run_rounds(peers[:2], 2)
            finished.set()

        threading.Thread(target=two_rounds, daemon=True).start()
        assert finished.wait(10), "peers waited for a neighbour that had left"
        assert peers[0].neighbour_misses == 0
    finally:
        for p in peers:
            p.close()


def test_a_forming_peer_does_not_wait_for_a_neighbour_that_already_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short run can end before the founder hears its neighbour say it is ready (here the
    founder loses every ``ready`` peer 1 sends): once peer 1 has left, the founder forms
    without it instead of waiting out its start-up timeout (a benchmark's peer died so)."""
    receive = Peer._receive

    def lossy(peer: Peer, msg: Any) -> None:
        if not (peer.id == 0 and msg.sender == 1 and msg.kind == "ready"):
            receive(peer, msg)

    monkeypatch.setattr(Peer, "_receive", lossy)
    listening, founder, formed = threading.Event(), [], threading.Event()

    def found() -> None:
        founder.append(
            Peer(torch.nn.Linear(3, 2), min_peers=2, startup_timeout=60,
                 on_listening=lambda address: (founder.append(address), listening.set()))
        )  # fmt: skip
        formed.set()

    threading.Thread(target=found, daemon=True).start()
    assert listening.wait(30)
    joiner = Peer(torch.nn.Linear(3, 2), bootstrap=founder[0], min_peers=2, startup_timeout=60)
    try:
        assert not formed.wait(1.5), "the founder formed without hearing peer 1 say ready"
        joiner.close()
        assert formed.wait(10), "the founder waits for a neighbour that left"
        assert founder[1].membership.gone(1)
    finally:
        joiner.close()
        if len(founder) > 1:
            founder[1].close()


def test_a_newcomer_joins_a_running_swarm_with_a_neighbours_model() -> None:
    peers = make_swarm(3, "complete", [0.0, 10.0, 20.0], round_timeout=2)
    stop = threading.Event()
    threads = train_in_background(peers, stop)
    wait_for(lambda: all(p.round >= 5 for p in peers), 30, "the swarm to run a few rounds")
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(999.0)
    joiner = None
    try:
        joiner = Peer(model, bootstrap=peers[1].address, topology="complete", round_timeout=2)
        assert value_of(joiner) == pytest.approx(10.0)  # the neighbour's model, not its own
        since = joiner.membership.get(joiner.id).since  # type: ignore[union-attr]
        assert joiner.id == 3 and since > 0 and joiner.round >= since
        for _ in range(30):
            joiner.gossip()
        assert joiner.neighbour_misses == 0
        assert sorted(joiner.neighbours()) == [0, 1, 2]
        assert all(3 in p.neighbours(joiner.round) for p in peers)
        assert value_of(joiner) == pytest.approx(10.0)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for p in [*peers, joiner]:
            if p is not None:
                p.close()


def tables(peers: list[Peer]) -> list[dict[int, str]]:
    """Each peer's view of the swarm: id -> address of the members still in."""
    return [{m.id: m.address for m in p.membership.members() if m.until is None} for p in peers]


@pytest.mark.parametrize("ranks", [(None, None), (7, 7)], ids=["any-id", "same-rank"])
def test_two_newcomers_let_in_at_once_by_different_members_end_with_different_ids(
    ranks: tuple[int | None, int | None], caplog: pytest.LogCaptureFixture
) -> None:
    # News between members takes 0.5 s, so members 1 and 2 both hand out the next id.
    slow = LinkProfile(latency_s=0.5)
    peers = make_swarm(
        3, "complete", [0.0, 10.0, 20.0], round_timeout=2, link=slow, join_margin_rounds=3
    )
    stop = threading.Event()
    joiners: dict[int, Peer] = {}
    errors: dict[int, BaseException] = {}

    def join(i: int) -> None:
        try:
            joiners[i] = Peer(
                torch.nn.Linear(3, 2),
                rank=ranks[i],
                bootstrap=peers[1 + i].address,
                topology="complete",
                round_timeout=2,
            )
            while not stop.is_set():
                joiners[i].gossip()
        except BaseException as exc:  # checked below
            errors[i] = exc

    threads = train_in_background(peers, stop)
    try:
        wait_for(lambda: all(p.round >= 3 for p in peers), 30, "the swarm to run")
        threads += [threading.Thread(target=join, args=(i,)) for i in range(2)]
        for t in threads[3:]:
            t.start()
        wait_for(lambda: len(joiners) + len(errors) == 2, 60, "both joiners to start or fail")
        if ranks[0] is None:
            everyone = [*peers, *joiners.values()]

            def agreed() -> bool:  # the loser may learn of it only after it started
                views = tables(everyone)
                return len(views[0]) == 5 and all(t == views[0] for t in views)

            wait_for(agreed, 30, "every peer to agree on 5 members")
            assert not errors
            assert "let in at the same moment; asking for an id again" in caplog.text
            table = tables(everyone)[0]
            assert {table[j.id] for j in joiners.values()} == {j.address for j in joiners.values()}
            first = max(j.round for j in joiners.values())
            wait_for(lambda: all(p.round >= first + 5 for p in everyone), 60, "rounds together")
            assert all(sorted(p.neighbours()) == sorted(set(table) - {p.id}) for p in everyone)
        else:
            wait_for(lambda: errors, 30, "the joiner that lost id 7 to stop")
            ((loser, error),) = errors.items()
            assert "id 7 is taken; choose another rank or leave it out" in str(error)
            winner = joiners[1 - loser]
            assert all(t[7] == winner.address for t in tables([*peers, winner]))
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for p in [*peers, *joiners.values()]:
            p.close()


def test_two_newcomers_let_in_at_once_while_the_swarm_forms_end_with_different_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same race before round 0: the newcomer that lost the id asks again, and the swarm
    of five forms (it used to stop with "start this one again")."""
    slow = LinkProfile(latency_s=0.5)  # members 1 and 2 both hand out id 3
    settings: dict[str, Any] = dict(topology="complete", min_peers=5, link=slow, round_timeout=2)
    peers: dict[str, Peer] = {}
    errors: list[BaseException] = []
    addresses: dict[str, str] = {}
    let_in = {name: threading.Event() for name in ("founder", "a", "b", "x", "y")}

    def start(name: str, via: str | None) -> None:
        def listening(address: str) -> None:
            addresses[name] = address

        def members(table: list[Member]) -> None:
            if any(m.address == addresses.get(name) for m in table):
                let_in[name].set()  # it has its own entry: it can let others in

        try:
            bootstrap = addresses[via] if via else None
            peers[name] = Peer(torch.nn.Linear(3, 2), bootstrap=bootstrap, on_listening=listening,
                               on_members=members, **settings)  # fmt: skip
        except BaseException as exc:  # checked below
            errors.append(exc)

    threads: list[threading.Thread] = []

    def launch(name: str, via: str | None) -> None:
        threads.append(threading.Thread(target=start, args=(name, via)))
        threads[-1].start()

    stop = threading.Event()
    try:
        launch("founder", None)
        assert let_in["founder"].wait(30)
        launch("a", "founder")
        launch("b", "founder")
        assert let_in["a"].wait(30) and let_in["b"].wait(30)
        launch("x", "a")
        launch("y", "b")
        wait_for(lambda: len(peers) + len(errors) == 5, 60, "all five to form or fail")
        assert not errors, errors
        assert "let in at the same moment; asking for an id again" in caplog.text
        everyone = list(peers.values())
        assert sorted(p.id for p in everyone) == [0, 1, 2, 3, 4]
        wait_for(lambda: all(t == tables(everyone)[0] for t in tables(everyone)), 30, "one table")
        threads += train_in_background(everyone, stop)
        wait_for(lambda: all(p.round >= 3 for p in everyone), 60, "rounds together")
        assert all(len(p.neighbours()) == 4 for p in everyone)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for p in peers.values():
            p.close()


def test_a_peer_that_learns_late_its_id_went_to_another_asks_again_and_keeps_its_model() -> None:
    # nobody dies here: a dead_after the busiest machine cannot reach between the joiner's
    # heartbeats (it trains only when the test says, and its watch thread may lag)
    peers = make_swarm(
        3, "complete", [0.0, 10.0, 20.0], round_timeout=1, heartbeat=0.2, dead_after=30
    )
    stop = threading.Event()
    threads = train_in_background(peers, stop)
    # The other newcomer listens on 127.0.0.1, a smaller address than the joiner's 127.0.0.2
    # (a socket that takes messages, so that closing the peers does not wait for it).
    other = zmq.Context.instance().socket(zmq.ROUTER)
    other.bind("tcp://127.0.0.1:0")
    wait_for(lambda: all(p.round >= 3 for p in peers), 30, "the swarm to agree on 10")
    joiner = Peer(
        torch.nn.Linear(3, 2),
        bootstrap=peers[0].address,
        topology="complete",
        listen="tcp://127.0.0.2:0",
    )
    try:
        for _ in range(5):
            joiner.gossip()
        assert joiner.id == 3 and value_of(joiner) == pytest.approx(10.0)
        with torch.no_grad():
            for p in joiner.model.parameters():
                p.fill_(11.0)  # its own progress, which it must keep
        # The other newcomer was let in as peer 3 from the same round.
        me = joiner.membership.get(3)
        assert me is not None
        for p in peers:
            p._merge([Member(3, other.getsockopt_string(zmq.LAST_ENDPOINT), me.since)])
        wait_for(joiner._lost_id, 10, "the members to tell the joiner")
        joiner.gossip()
        assert joiner.id == 4 and joiner.rejoins == 1
        # The welcoming member announces the new entry after its welcome: the others may
        # hear of it a moment after the joiner does.
        everyone = [*peers, joiner]
        wait_for(lambda: all(t.get(4) == joiner.address for t in tables(everyone)), 10, "news")
        assert 10.1 < value_of(joiner) < 11.0  # its 11 averaged with the others' 10 once
        for _ in range(3):
            joiner.gossip()
        assert 4 in peers[0].neighbours(joiner.round)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for p in [*peers, joiner]:
            p.close()
        other.close(linger=0)


def test_a_table_a_peer_sent_before_it_rejoined_ends_nobody() -> None:
    """Peer 2 thought peer 0 dead while cut off; its table saying so was queued and arrives
    after peer 2 rejoined. Taken in, it ended peer 0 everywhere (CI saw the cascade)."""
    peers = make_swarm(3, "complete", [0.0, 1.0, 2.0])
    ctx = zmq.Context.instance()
    old_life, newcomer = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    newcomer.bind("tcp://127.0.0.1:0")
    a = [p.address for p in peers]
    try:
        for p in peers[:2]:  # peer 2 was dropped and let back in from round 5
            p._merge([Member(2, a[2], since=5)])
        stale = [[0, a[0], 0, 3, ""], [1, a[1], 0, None, ""], [2, a[2], 0, None, ""]]
        fresh = [[0, a[0], 0], [1, a[1], 0], [2, a[2], 5], [3, newcomer.LAST_ENDPOINT.decode(), 9]]
        for i in (0, 1):  # in order on one connection: the fresh table shows the stale one came
            old_life.connect(a[i])
            for kind, table in (("dropped", stale), ("members", stale), ("members", fresh)):
                old_life.send_multipart(encode(kind, 2, 0, 0, meta={"members": table}))
            wait_for(
                lambda i=i: peers[i].membership.get(3), 10, f"peer {i} to hear the fresh table"
            )
            old_life.disconnect(a[i])
        assert [[m.until for m in p.membership.members()] for p in peers[:2]] == [[None] * 4] * 2
        assert all(p.core.rejoin_via is None for p in peers)
    finally:
        for p in peers:
            p.close()
        old_life.close(linger=0)
        newcomer.close(linger=0)


def test_asking_for_a_taken_id_is_refused_with_the_reason() -> None:
    peers = make_swarm(2, "ring", [0.0, 1.0])
    try:
        with pytest.raises(Exception, match="id 0 is taken"):
            Peer(torch.nn.Linear(3, 2), rank=0, bootstrap=peers[0].address, startup_timeout=10)
    finally:
        for p in peers:
            p.close()


def test_joining_an_address_where_nobody_listens_fails_clearly() -> None:
    # The start-up timeout is longer than the test may run: only the refused connection,
    # given up on after connect_wait, can end this with the error.
    with pytest.raises(PeerError, match=r"127\.0\.0\.1:9: connection refused"):
        Peer(torch.nn.Linear(3, 2), bootstrap="tcp://127.0.0.1:9", connect_wait=1.0,
             startup_timeout=3600)  # fmt: skip


def crash(peer: Peer) -> None:
    """Make ``peer`` vanish as a killed process does: sockets closed, no goodbye."""
    peer._closed = True
    peer._watch_stop.set()
    peer.transport.close(flush_timeout=0)


def rounds_until(peers: list[Peer], target: int, within: float) -> None:
    """Run rounds on ``peers`` (each in its own thread) until all reach round ``target``."""
    run_rounds(peers, 0)
    threads = [
        threading.Thread(target=lambda p=p: [p.gossip() for _ in range(target - p.round)])
        for p in peers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(within)
    assert all(p.round >= target for p in peers), [p.round for p in peers]


def test_a_dead_peer_is_declared_dead_and_the_ring_repairs_itself() -> None:
    """A peer that vanishes is dropped from a round all survivors agree on; from there the
    ring is rebuilt over the live members and nobody waits for the dead one."""
    peers = make_swarm(
        4, "ring", [0.0, 10.0, 20.0, 30.0], heartbeat=0.2, dead_after=2.0, round_timeout=60
    )
    try:
        run_rounds(peers, 3)
        crash(peers[3])
        survivors = peers[:3]
        wait_for(
            lambda: all(p.membership.gone(3) for p in survivors), 10, "peer 3 to be declared dead"
        )
        wait_for(
            lambda: len({p.membership.get(3).until for p in survivors}) == 1,  # type: ignore[union-attr]
            10,
            "the survivors to agree on the round peer 3 is dropped from",
        )
        until = survivors[0].membership.get(3).until  # type: ignore[union-attr]
        assert until is not None and until > 3
        rounds_until(survivors, until + 2, within=30)  # would take minutes if they waited
        assert sum(p.declared_dead for p in survivors) >= 1
        assert peers[0].neighbours(until) == [1, 2]  # the ring over 0, 1, 2
        values = [value_of(p) for p in survivors]
        assert max(values) - min(values) < 1e-4  # a 3-ring averages everyone exactly
        assert all(p.stats()["members"] == 3 for p in survivors)
    finally:
        for p in peers:
            p.close()


def test_an_error_in_one_heartbeat_pass_does_not_stop_the_heartbeats(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Peer 0's member callback fails (as writing peers.json once did) when it declares peer 2
    dead; its watch thread must go on, or peer 1 would soon declare peer 0 dead too."""
    peers = make_swarm(3, "complete", [0.0, 1.0, 2.0], heartbeat=0.1, dead_after=1.0)

    def disk_full(members: list[Member]) -> None:
        raise OSError("No space left on device")

    peers[0]._on_members = disk_full
    peers[1].dead_after = 3.0  # peer 0 notices first, in its watch thread
    try:
        run_rounds(peers, 2)
        crash(peers[2])
        wait_for(lambda: "error in the heartbeat thread; carrying on" in caplog.text, 10,
                 "peer 0's member callback to fail")  # fmt: skip
        wait_for(lambda: peers[1].membership.gone(2), 10, "peer 1 to declare peer 2 dead")
        failed = time.monotonic()  # peer 0's watch thread failed before this
        heard = peers[1].core.detector.heard_at
        # Nothing but peer 0's heartbeats reaches peer 1 now (no rounds run): heard past
        # peer 1's dead_after since the failure, they went on.
        wait_for(lambda: heard.get(0, 0.0) > failed + 3.5, 15, "peer 0's heartbeats to go on")
        assert not peers[1].membership.gone(0)
    finally:
        for p in peers:
            p.close()


def test_a_graceful_leave_drops_the_peer_from_the_round_it_announced() -> None:
    """The leaver is out from the round it announced. A leaver silent past ``dead_after``
    before that round is ended sooner (an end far ahead holds no place for good): on a
    loaded CI machine the 20 rounds took longer than the default 5 s, and one survivor
    ended it a round early; here nobody is overdue."""
    peers = make_swarm(4, "ring", [0.0, 10.0, 20.0, 30.0], round_timeout=60, dead_after=60)
    try:
        run_rounds(peers, 2)
        peers[3].close(reason="Ctrl-C")
        survivors = peers[:3]
        wait_for(lambda: all(p.membership.gone(3) for p in survivors), 10, "the leave to arrive")
        untils = {p.membership.get(3).until for p in survivors}  # type: ignore[union-attr]
        assert len(untils) == 1  # the round the leaver announced: its own plus the join margin
        until = untils.pop()
        assert until is not None and until >= 2 + 20
        assert all(p.membership.why_left(3) == "Ctrl-C" for p in survivors)
        rounds_until(survivors, until + 2, within=30)
        assert all(p.neighbour_misses == 0 and p.declared_dead == 0 for p in survivors)
        assert peers[1].neighbours(until - 1) == [0, 2] and peers[1].neighbours(until) == [0, 2]
        assert peers[0].neighbours(until - 1) == [1, 3] and peers[0].neighbours(until) == [1, 2]
    finally:
        for p in peers:
            p.close()


def test_a_peers_threads_report_the_member_table_in_turn_so_the_latest_is_written_last() -> None:
    """Two threads report the table (``on_members``, what writes ``peers.json``): the first
    is still writing the table it read when a member comes and the second reports. The
    second waits its turn, so the newer table is the one written last; reporting at once,
    the first wrote its older table over it (CI saw peers.json list two of three hosts)."""
    written: list[list[int]] = []
    hold, writing, release = [False], threading.Event(), threading.Event()

    def report(members: list[Member]) -> None:
        if hold.pop() if hold else False:
            writing.set()
            release.wait(30)
        written.append([m.id for m in members])

    peer = Peer(torch.nn.Linear(2, 2), on_members=report, min_peers=1)
    try:
        hold[:] = [True]  # the next report stops midway
        first = threading.Thread(target=peer._members_changed)
        first.start()
        assert writing.wait(30)
        peer.membership.merge([Member(5, "tcp://127.0.0.1:1")])
        second = threading.Thread(target=peer._members_changed)
        second.start()
        second.join(0.5)  # reporting at once, it is done by now; in turn, it waits
        release.set()
        first.join(30)
        second.join(30)
    finally:
        peer.close()
    assert written[-2:] == [[0], [0, 5]]
