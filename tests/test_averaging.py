"""The averaging rules: a missing neighbour's weight stays with the peer and a late model
still pairs up, so one-sided loss keeps the swarm's average exactly (in the simulator);
PowerGossip keeps the average and its edges recover from a lost message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import small_config

from gossipdl.averaging import DenseGossip, build_averager
from gossipdl.averaging.base import Arrival, Round, mix
from gossipdl.averaging.beer import Beer
from gossipdl.averaging.dense import LATE_ROUNDS
from gossipdl.averaging.power_gossip import PowerGossip
from gossipdl.averaging.robust import parse_defence
from gossipdl.compression import CodecError, Payload
from gossipdl.protocol.core import GossipCore
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import Simulation


def simulation(
    tmp_path: Path, faults: list[dict[str, Any]], steps: int = 40, checkpoint_every: int = 0
) -> Simulation:
    """Four peers on a ring, dense gossip every step and no training (the optimizers' steps
    do nothing), each starting from its own random model: whatever moves the average is
    the averaging."""
    config = small_config(
        tmp_path,
        peers=4,
        steps=steps,
        algorithm="dense",
        round_timeout=0.05,
        faults=faults,
        checkpoint_every=checkpoint_every,
        profiles={"all": {"peers": "0-3", "step_time": "10ms"}},
    )
    run = RunDir(config.out)
    run.create()
    sim = Simulation(config, run)
    for peer in sim.peers:
        generator = torch.Generator().manual_seed(peer.id)
        with torch.no_grad():
            for p in peer.params:
                p.copy_(torch.randn(p.shape, generator=generator))
        peer.optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
        peer.core.reference = peer.flat()
        peer.core.published = (peer.core.round, peer.flat())
    return sim


def swarm_mean(sim: Simulation) -> torch.Tensor:
    return torch.stack([p.flat() for p in sim.peers]).double().mean(0)


def test_one_sided_loss_keeps_the_swarm_average_exactly(tmp_path: Path) -> None:
    """Peer 0's models to peer 1 are held for 150 ms (0 gets 1's; 1 times out on 0's) and
    then arrive late: 1 leaves 0's weight on itself, then pairs the late models with its own
    of their rounds, so the edge's two halves cancel and the average does not move."""
    sim = simulation(tmp_path, [{"at": "0.01s", "clog": "0>1"}, {"at": "0.15s", "unclog": "0>1"}])
    start = swarm_mean(sim)
    spread = float((torch.stack([p.flat() for p in sim.peers]).double() - start).norm())
    sim.run()
    assert sim.peers[1].core.counters.neighbour_misses >= 2  # the loss happened, one-sided
    drift = float((swarm_mean(sim) - start).norm())
    assert drift < 1e-6 * spread
    end = torch.stack([p.flat() for p in sim.peers]).double()
    assert float((end - end.mean(0)).norm()) < 0.1 * spread  # and the swarm still mixed


def test_a_missing_neighbours_weight_stays_with_the_peer() -> None:
    """The rule itself: x_i + Σ W_ij (x_j − x_i) over what arrived."""
    x, a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), torch.tensor([5.0, 4.0])
    rnd = Round(3, {1: 0.25, 2: 0.25}, 0.5)
    assert mix(x, rnd, [Arrival(0.25, a, 3)]).tolist() == [1.5, 1.5]  # 0.75 x + 0.25 a
    assert mix(x, rnd, [Arrival(0.25, a, 3), Arrival(0.25, b, 3)]).tolist() == [2.5, 2.0]
    assert mix(x, rnd, []).tolist() == x.tolist()


def test_a_newcomer_catches_up_with_its_neighbours_models_and_a_defended_one_with_theirs() -> None:
    """Plain: the round's weighted mean of what arrived. With a defence: the neighbour nearest
    the rest, so a liar among them moves it nowhere. Nothing arrived: its own model."""
    a, b, middle = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5])
    arrived = {1: Arrival(0.25, a, 3), 2: Arrival(0.5, b, 3)}
    mean = DenseGossip().catch_up(arrived)
    assert mean is not None and torch.allclose(mean, (a + 2 * b) / 3)
    arrived.update({3: Arrival(0.1, middle, 3), 4: Arrival(0.1, torch.full((2,), 90.0), 3)})
    defended = DenseGossip(defence=parse_defence("balance")).catch_up(arrived)
    assert defended is not None and torch.equal(defended, middle)  # the one nearest the rest
    assert DenseGossip().catch_up({}) is None
    assert build_averager("choco", "topk:0.5", 0).catch_up(arrived) is None  # copies, no models


@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_a_restarted_peer_starts_from_its_neighbours_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_every: int
) -> None:
    """Without a checkpoint it takes a neighbour's model when it is let in, with one it
    resumes its own; either way it starts a join margin (20 rounds) later, that far behind
    (fault-search seeds 19122, 19203, 31140: with BALANCE the stale models and the swarm's
    rejected each other, and peers were evicted). The first round that brings its
    neighbours' models ends on their weighted mean, not on a mix with its own stale one."""
    merges: list[tuple[torch.Tensor, dict[int, Any], torch.Tensor]] = []
    merge = GossipCore._merge

    def record(self: GossipCore, x: torch.Tensor, rnd: Round, got: dict[int, Any]) -> Any:
        out = merge(self, x, rnd, got)
        if self.id == 2 and self.first_round > 0 and got and not merges:
            arrived = {j: (rnd.weights[j], value.clone()) for j, (value, _) in got.items()}
            merges.append((x.clone(), arrived, out))
        return out

    monkeypatch.setattr(GossipCore, "_merge", record)
    faults = [{"at": "0.05s", "kill": "2"}, {"at": "0.1s", "restart": "2"}]
    simulation(tmp_path, faults, steps=120, checkpoint_every=checkpoint_every).run()
    ((own, arrived, out),) = merges
    total = sum(w for w, _ in arrived.values())
    mean = sum(w / total * v for w, v in arrived.values())
    assert len(arrived) == 2 and torch.allclose(out, mean, atol=1e-5)
    assert not torch.allclose(own, mean, atol=1e-2)  # its own model was behind


def test_a_late_model_pairs_with_the_own_model_of_its_round_unless_too_old() -> None:
    gossip = DenseGossip()
    assert gossip.incoming(torch.tensor([2.0]), Round(3, {1: 0.5}, 0.5), {}, [1]).tolist() == [2.0]
    late = [(1, Arrival(0.5, torch.tensor([6.0]), 3))]
    now = {1: Arrival(0.5, torch.tensor([4.0]), 4)}
    # round 4: 0.5·2 + 0.5·4, and round 3's edge late: 0.5·(6 − 2) with the own model of round 3
    assert gossip.incoming(
        torch.tensor([2.0]), Round(4, {1: 0.5}, 0.5), now, [], late
    ).tolist() == [5.0]

    old = DenseGossip()
    for r in range(3, 3 + LATE_ROUNDS + 1):  # 1 missing in every round: round 3 falls out
        old.incoming(torch.tensor([2.0]), Round(r, {1: 0.5}, 0.5), {}, [1])
    after = old.incoming(torch.tensor([2.0]), Round(9, {1: 0.5}, 0.5), {}, [1], late)
    assert after.tolist() == [2.0]


def ring_rounds(
    gossips: list[PowerGossip],
    xs: list[torch.Tensor],
    rounds: range,
    lose: set[tuple[int, int, int]] = frozenset(),
) -> list[torch.Tensor]:
    """PowerGossip rounds on a ring of ``len(xs)``, messages (round, sender, receiver) in
    ``lose`` dropped on the way."""
    n, cpu = len(xs), torch.device("cpu")
    for t in rounds:
        rnds = [Round(t, {(i - 1) % n: 1 / 3, (i + 1) % n: 1 / 3}, 1 / 3) for i in range(n)]
        outs = [g.outgoing(x, r) for g, x, r in zip(gossips, xs, rnds, strict=True)]
        xs = [
            g.incoming(
                x,
                r,
                {
                    j: Arrival(w, g.decode(outs[j][i], False, x.numel(), cpu), t)
                    for j, w in r.weights.items()
                    if (t, j, i) not in lose
                },
                [j for j in r.weights if (t, j, i) in lose],
            )
            for i, (g, x, r) in enumerate(zip(gossips, xs, rnds, strict=True))
        ]
    return xs


def powergossip_ring(n: int = 4) -> tuple[list[PowerGossip], list[torch.Tensor]]:
    gossips = [PowerGossip() for _ in range(n)]
    for g in gossips:
        g.bind_layout([(20, 10), (20,), (5, 20)])
    xs = [torch.randn(320, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    return gossips, xs


def spread(xs: list[torch.Tensor]) -> float:
    x = torch.stack(xs).double()
    return float((x - x.mean(0)).norm())


def test_powergossip_keeps_the_average_and_brings_the_models_together() -> None:
    gossips, xs = powergossip_ring()
    mean = torch.stack(xs).double().mean(0)
    ends = ring_rounds(gossips, xs, range(80))
    assert float((torch.stack(ends).double().mean(0) - mean).norm()) < 1e-5
    assert spread(ends) < 0.05 * spread(xs)
    payload = gossips[0].outgoing(ends[0], Round(80, {1: 1 / 3, 3: 1 / 3}, 1 / 3))
    assert set(payload) == {1, 3}  # one payload per neighbour, of the edge's own projections
    assert payload[1].nbytes < 4 * 320 / 3  # (10 + 20) + 20 biases floats against 320 dense


@pytest.mark.parametrize("numel", [1, 7, 10, 325])
def test_powergossip_without_a_bound_layout_takes_any_length(numel: int) -> None:
    """A vector whose length is not rows × cols (the Python API without ``bind_layout``) is
    its largest near-square matrix plus the rest sent as it is: rounds keep the average."""
    gossips = [PowerGossip() for _ in range(4)]
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    mean = torch.stack(xs).double().mean(0)
    ends = ring_rounds(gossips, xs, range(30))
    assert float((torch.stack(ends).double().mean(0) - mean).norm()) < 1e-5
    assert spread(ends) < 0.5 * spread(xs)


def test_a_powergossip_edge_that_lost_a_message_restarts_in_step_within_two_rounds() -> None:
    """Peer 1 loses peer 0's round-5 message: 1 restarts the edge at epoch 1, 0 (which got
    1's and moved on) sees the mismatch next round, and both go on at epoch 2 from round 7."""
    gossips, xs = powergossip_ring()
    ends = ring_rounds(gossips, xs, range(12), lose={(5, 0, 1)})
    edge_01, edge_10 = gossips[0]._edges[1], gossips[1]._edges[0]
    assert (edge_01.epoch, edge_01.step) == (edge_10.epoch, edge_10.step) == (2, 5)
    assert spread(ring_rounds(gossips, ends, range(12, 80))) < 0.05 * spread(xs)


def test_a_sparse_broadcast_masks_the_momentum_it_sent(tmp_path: Path) -> None:
    """DGC's momentum factor masking: after each round of a top-10% broadcast, each peer's
    SGD momentum is zero where its update went out and untouched elsewhere."""
    config = small_config(
        tmp_path, peers=3, steps=12, algorithm="broadcast", codec="topk:0.1",
        topology="complete", momentum=0.9,
    )  # fmt: skip
    run = RunDir(config.out)
    run.create()
    sim = Simulation(config, run)
    sim.run()
    for peer in sim.peers:
        sent = peer.core.averager.sent_mask()
        assert sent is not None and 0 < int(sent.sum()) < sent.numel()
        momentum = torch.cat(
            [peer.optimizer.state[p]["momentum_buffer"].reshape(-1) for p in peer.params]
        )
        assert not momentum[sent].any() and momentum[~sent].abs().sum() > 0
    assert DenseGossip().sent_mask() is None  # only a sparsifying broadcast masks


@pytest.mark.parametrize("keep_copies", [False, True], ids=["sums", "copies"])
def test_beer_tracks_the_mean_direction_and_moves_the_mean_model_by_it(keep_copies: bool) -> None:
    """Four BEER peers on a ring with top-10%, each pulled its own way every round, at a
    learning rate that anneals from 1 to 0.01 (each round's update is the rate times the
    peer's fixed direction): the mean of the trackers is the mean direction and the mean
    model moves by the rate times it, round after round (the public copies' sums cancel),
    and each peer follows the mean direction, not its own, so the models stay together; once
    the rate has annealed their spread shrinks with it (tracking updates instead, the
    correction kept the size of the early steps and held the models apart). The same with
    each neighbour's copies kept apart, as a defended peer keeps them."""
    n, numel, rounds, cpu = 4, 200, 120, torch.device("cpu")
    peers = [Beer("topk:0.1", keep_copies=keep_copies) for _ in range(n)]
    start = torch.randn(numel, generator=torch.Generator().manual_seed(9))
    for p in peers:
        p.begin(start)
    xs = [start.clone() for _ in range(n)]
    directions = [
        0.05 * torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)
    ]  # each peer pulls its own way, the same every round
    mean_direction = torch.stack(directions).mean(0)
    for t in range(rounds):
        lr = 1.0 if t < rounds // 2 else 0.01
        before = torch.stack(xs).mean(0)
        xs = [x + lr * d for x, d in zip(xs, directions, strict=True)]
        rnds = [Round(t, {(i - 1) % n: 1 / 3, (i + 1) % n: 1 / 3}, 1 / 3, resync=t == 0, lr=lr)
                for i in range(n)]  # fmt: skip
        payloads = [p.outgoing(x, r) for p, x, r in zip(peers, xs, rnds, strict=True)]
        outs = [p.vouch() if t == 0 else q for p, q in zip(peers, payloads, strict=True)]
        xs = [
            p.incoming(x, r, {j: Arrival(w, p.decode(outs[j], t == 0, numel, cpu), t, t == 0)
                              for j, w in r.weights.items()}, [])
            for p, x, r in zip(peers, xs, rnds, strict=True)
        ]  # fmt: skip
        trackers = torch.stack([p.v for p in peers if p.v is not None])
        # d/η at η 0.01 magnifies the float32 rounding of x − x_last a hundredfold
        torch.testing.assert_close(trackers.mean(0), mean_direction, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(torch.stack(xs).mean(0), before + lr * mean_direction)
        if t == rounds // 2 - 1:
            spread = float((torch.stack(xs) - torch.stack(xs).mean(0)).norm())
    x = torch.stack(xs)
    apart = float((torch.stack(directions) - mean_direction).norm())  # one own step at lr 1
    assert spread < apart  # own updates alone: 60 × apart
    # the spread shrinks with the rate (0.0101 of it; tracking updates left 0.024)
    assert float((x - x.mean(0)).norm()) < 0.015 * spread
    assert all(p.resynced == 0 for p in peers)  # one vouched start, no dense copy


def test_beer_refuses_what_choco_refuses_and_payloads_that_are_not_its_own() -> None:
    with pytest.raises(ValueError, match="needs no"):
        Beer("topk:0.01+ef")
    beer = Beer("topk:0.1")
    payload, _ = beer.codec.encode(torch.randn(50))
    for bad in (payload, Payload(payload.arrays, {"n": 99}), Payload((), {"n": 0, "x.k": 1})):
        with pytest.raises(CodecError):
            beer.decode(bad, False, 50, torch.device("cpu"))


@pytest.mark.parametrize("spec", ["qsgd:4", "topk:0.5+qsgd:4", "ternary"])
def test_each_peer_draws_its_own_rounding_so_the_mean_error_shrinks(spec: str) -> None:
    """Eight peers compress one vector: built for their own ids, their random draws differ
    and the error of the mean of their estimates is well under one peer's (independent
    errors average out, ~1/√8); one shared seed gave every peer the same estimate, an
    error the mean kept. A peer's draws stay reproducible from the swarm's seed and id."""
    v = torch.randn(4096, generator=torch.Generator().manual_seed(5))

    def estimates(peer: int) -> torch.Tensor:
        averager = build_averager("choco", spec, seed=7, peer=peer)
        return averager.codec.encode(v)[1]

    each = [estimates(i) for i in range(8)]
    assert torch.equal(each[3], estimates(3))
    one = float((each[0] - v).norm())
    mean = float((torch.stack(each).mean(0) - v).norm())
    assert mean < 0.6 * one, (mean, one)
    shared = build_averager("choco", spec, seed=7)
    assert torch.equal(
        shared.codec.encode(v)[1], build_averager("choco", spec, seed=7).codec.encode(v)[1]
    )


def test_powergossip_peers_keep_the_swarms_projectors_with_draws_of_their_own() -> None:
    """PowerGossip's projectors come from the swarm's seed, which every peer shares: built
    for two different peers, they draw the same projector for an edge."""
    a, b = (build_averager("powergossip", "powersgd:1", seed=4, peer=i) for i in (0, 1))
    assert isinstance(a, PowerGossip) and isinstance(b, PowerGossip)
    layout = a._layout(30)
    for x, y in zip(
        a._draw(0, 1, layout, torch.device("cpu")),
        b._draw(0, 1, layout, torch.device("cpu")),
        strict=True,
    ):
        assert torch.equal(x, y)


def test_beer_trackers_start_again_when_members_go_so_their_mean_is_the_mean_direction() -> None:
    """Four BEER peers on a ring track the mean of their fixed directions; then peer 3 dies
    and the other three form a new graph at round 30, which every one of them sees as a
    changed swarm (``reshaped``). The tracker mass peer 3 took with it would bias the mean
    tracker for good (the models would drift along it); each restarts from its own
    direction there, so the three trackers' mean is their mean direction again, and stays."""
    numel, cpu = 100, torch.device("cpu")
    peers = [Beer("topk:0.2") for _ in range(4)]
    start = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    directions = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for p in peers:
        p.begin(start)
    xs = [start.clone() for _ in range(4)]
    for t in range(40):
        live = range(4) if t < 30 else range(3)
        resync = t in (0, 30)
        rows = (
            [{(i - 1) % 4: 1 / 3, (i + 1) % 4: 1 / 3} for i in live]
            if t < 30
            else [
                {j: 1 / 3 for j in live if j != i}
                for i in live  # three: a complete graph
            ]
        )
        rnds = {i: Round(t, rows[i], 1 / 3, resync, lr=0.1, reshaped=t == 30) for i in live}
        xs = [x + 0.1 * d for x, d in zip(xs, directions, strict=True)]
        sent = {i: peers[i].outgoing(xs[i], rnds[i]) for i in live}
        if resync:
            sent = {i: peers[i].vouch() if t == 0 else peers[i].public_copy() for i in live}
        for i in live:
            arrived = {
                j: Arrival(w, peers[i].decode(sent[j], resync, numel, cpu), t, resync)
                for j, w in rnds[i].weights.items()
            }
            xs[i] = peers[i].incoming(xs[i], rnds[i], arrived, [])
        trackers = torch.stack([peers[i].v for i in live if peers[i].v is not None])
        mean_direction = torch.stack([directions[i] for i in live]).mean(0)
        torch.testing.assert_close(trackers.mean(0), mean_direction, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("algorithm", ["beer", "choco"])
def test_a_peer_back_with_a_new_life_sends_its_public_copy_dense(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    """Peer 3 of a ring of 4 dies and comes back as a newcomer. Its first round is a changed
    swarm for its neighbours, who rebuild their sums from dense copies there: it vouched
    for its copy instead, a model nobody held, so the rebuild failed and they mixed with
    sums holding its previous life's copy for three rounds (CHOCO's average moved; BEER's
    trackers, started again from the own directions there, stayed off the mean direction
    for good: 0.38 against a direction of 1.6). Now its copy comes dense."""
    from gossipdl.averaging.base import Vouch
    from gossipdl.averaging.choco import Choco, PublicCopies

    averager: type[PublicCopies] = Beer if algorithm == "beer" else Choco
    late_vouches: list[int] = []
    incoming = averager.incoming

    def watch(self: Any, x: torch.Tensor, rnd: Round, arrived: Any, *rest: Any) -> Any:
        if rnd.index > 0:
            late_vouches.extend(j for j, a in arrived.items() if isinstance(a.value, Vouch))
        return incoming(self, x, rnd, arrived, *rest)

    monkeypatch.setattr(averager, "incoming", watch)
    directions: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    if algorithm == "beer":
        outgoing = Beer.outgoing

        def record(self: Beer, x: torch.Tensor, rnd: Round) -> Any:
            sent = outgoing(self, x, rnd)
            assert self._direction is not None and self.v is not None
            directions[(id(self), rnd.index)] = (self._direction.clone(), self.v.clone())
            return sent

        monkeypatch.setattr(Beer, "outgoing", record)
    config = small_config(
        tmp_path, peers=4, steps=150, algorithm=algorithm, codec="topk:0.1",
        partition="dirichlet:0.1", round_timeout=0.5,
        profiles={"all": {"peers": "0-3", "step_time": "50ms"}},
        faults=[{"at": "3s", "kill": "3"}, {"at": "5s", "restart": "3"}],
    )  # fmt: skip
    sim = Simulation(config, RunDir(config.out).create())
    sim.run()
    assert sim.peers[3].core.first_round > 0  # it came back with a new life
    assert not late_vouches, "a newcomer vouched for a copy its neighbours do not hold"
    if algorithm == "beer":
        by_round: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for (_, index), pair in directions.items():
            by_round.setdefault(index, []).append(pair)
        checked = 0
        for index, pairs in sorted(by_round.items()):
            if len(pairs) == 4 and index >= sim.peers[3].core.first_round:
                direction = sum(d for d, _ in pairs)
                tracker = sum(v for _, v in pairs)
                assert float((tracker - direction).norm()) < 1e-3 * float(direction.norm())
                checked += 1
        assert checked > 40


def test_after_its_members_changed_a_peer_mixes_only_once_its_sums_are_rebuilt() -> None:
    """CHOCO peer 0 of a ring of 4 whose neighbour 3 came back with a new life (the round is
    ``reshaped``, the row the same): the dense copies of that round lack 3's, so the
    rebuild fails. Its s still holds 3's previous copy: it must not mix with it, in that
    round or the ones before the resync it asks for, and mixes again once that succeeds."""
    start = torch.randn(20, generator=torch.Generator().manual_seed(0))
    peer = build_averager("choco", "topk:0.5", 0)
    peer.begin(start)
    row = {1: 1 / 3, 3: 1 / 3}
    copies = {j: start + j for j in (1, 3)}

    def round_(t: int, dense: dict[int, torch.Tensor], reshaped: bool = False) -> torch.Tensor:
        rnd = Round(t, row, 1 / 3, resync=bool(dense), reshaped=reshaped)
        x = start + 0.5
        peer.outgoing(x, rnd)
        arrived = {j: Arrival(w, dense[j], t, True) for j, w in row.items() if j in dense}
        return peer.incoming(x, rnd, arrived, [j for j in row if j not in dense])

    x = start + 0.5
    assert not torch.equal(round_(0, copies), x)  # rebuilt: it mixes
    assert not torch.equal(round_(1, {}), x)
    assert torch.equal(round_(2, {1: copies[1]}, reshaped=True), x)  # 3's copy missing
    assert peer.needs_resync
    assert torch.equal(round_(3, {}), x)  # still owed a rebuild: s holds 3's old copy
    assert torch.equal(round_(4, {}), x)
    assert not torch.equal(round_(5, {1: copies[1], 3: copies[3] + 7}), x)  # rebuilt


def test_beer_with_a_layerwise_codec_binds_its_trackers_codec_to_the_layers_too(
    tmp_path: Path,
) -> None:
    """BEER's tracker has a codec of its own: left unbound to the model's layers, PowerSGD
    compressed the tracker as one matrix, which receivers (decoding layer by layer) refused:
    118 of 120 messages a peer dropped, and the swarm never mixed."""
    from gossipdl.experiments.simulated import simulate

    config = small_config(
        tmp_path, peers=4, steps=20, algorithm="beer", codec="powersgd:1", model="mlp",
        hidden=[16], round_timeout=0.5,
    )  # fmt: skip
    summary = simulate(config, step_time=0.05)
    assert summary["peers_finished"] == 4
    run = RunDir(config.out)
    for peer in range(4):
        last = list(run.records(peer))[-1]
        assert last["messages_dropped"] == 0, last["dropped_reasons"]
        assert last["model_messages_sent"] == 2 * 20  # a message to each neighbour a round
