"""CHOCO-SGD over real sockets: exact mixing when lossless, consensus under heavy
compression with the average preserved, and a resync after a message is lost."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_peer_api import make_swarm, run_rounds

from gossipdl import Peer
from gossipdl.averaging import Beer, Choco, PowerGossip, auto_gamma
from gossipdl.averaging.base import Arrival, Round
from gossipdl.averaging.consensus import consensus_spreads
from gossipdl.compression import build_codec
from gossipdl.protocol.kinds import RESYNC_LEAD
from gossipdl.topologies import build_topology


def vectors(peers: list[Peer]) -> np.ndarray:
    ordered = sorted(peers, key=lambda p: p.id)
    return np.stack(
        [torch.cat([q.detach().reshape(-1) for q in p.model.parameters()]).numpy() for p in ordered]
    ).astype(np.float64)


def randomize(peers: list[Peer]) -> None:
    for peer in peers:
        gen = torch.Generator().manual_seed(peer.id)
        with torch.no_grad():
            for q in peer.model.parameters():
                q.copy_(torch.randn(q.shape, generator=gen) * 10)


def close_all(peers: list[Peer]) -> None:
    for p in peers:
        p.close()


def test_lossless_choco_with_gamma_one_is_exactly_dense_gossip() -> None:
    """The first round vouches for the model the peers started from (one model here: the
    randomising comes after, as a local step would) and mixes nothing; from there each
    round is one dense gossip step: W³ after three more."""
    n = 5
    peers = make_swarm(n, "ring", [0.0] * n, algorithm="choco", codec="none", gamma=1.0)
    try:
        randomize(peers)
        start = vectors(peers)
        run_rounds(peers, 4)
        w = build_topology("ring", n).mixing_matrix()
        np.testing.assert_allclose(vectors(peers), np.linalg.matrix_power(w, 3) @ start, atol=1e-4)
        assert all(isinstance(p.averager, Choco) for p in peers)
    finally:
        close_all(peers)


def test_peers_that_start_from_one_model_send_no_dense_copy_in_their_first_round() -> None:
    """The first round's public copies: a vouch (the copy's sha256) where the models are one,
    a dense resync a few rounds later where they are not."""
    n, width = 3, 5000
    same = make_swarm(n, "ring", [0.5] * n, width=width, codec="topk:0.01")
    apart = make_swarm(n, "ring", [0.5, 0.6, 0.7], width=width, codec="topk:0.01")
    try:
        dense_copy = 4 * same[0].numel
        formed = [p.stats()["bytes_sent"] for p in same + apart]
        run_rounds(same, RESYNC_LEAD + 2)
        run_rounds(apart, RESYNC_LEAD + 2)
        sent = [p.stats()["bytes_sent"] - b for p, b in zip(same + apart, formed, strict=True)]
        assert all(p.resyncs == 0 for p in same) and max(sent[:n]) < dense_copy / 4, sent
        assert all(p.resyncs == 1 for p in apart) and min(sent[n:]) > 2 * dense_copy, sent
        assert consistent(apart, "ring")
    finally:
        close_all(same + apart)


def consistent(peers: list[Peer], topology: str) -> bool:
    """Every s_i equals Σ_j W_ij x̂_j: the invariant a lost message breaks."""
    w = build_topology(topology, len(peers)).mixing_matrix()
    ordered = sorted(peers, key=lambda p: p.id)
    x_hat = torch.stack([p.averager.x_hat for p in ordered])  # type: ignore[attr-defined]
    expected = torch.tensor(w, dtype=torch.float32) @ x_hat
    s = torch.stack([p.averager.s for p in ordered])  # type: ignore[attr-defined]
    return bool(torch.allclose(s, expected, atol=1e-4))


def test_a_lost_message_is_detected_and_repaired_by_a_dense_resync() -> None:
    peers = make_swarm(3, "complete", [0.0] * 3, width=50, codec="topk:0.2", round_timeout=5)
    try:
        randomize(peers)
        run_rounds(peers, 5)
        assert consistent(peers, "complete")
        lossy = next(p for p in peers if p.id == 0)
        lossy.core.loss = 1.0  # drop everything peer 0 sends for one round, on purpose

        def restore(peer: Peer) -> None:
            if peer is lossy and peer.round == 6:
                peer.core.loss = 0.0

        run_rounds(peers, 2, before=restore)
        assert lossy.stats()["messages_dropped"]["injected_loss"] == 2
        assert not consistent(peers, "complete")
        run_rounds(peers, 5)
        assert consistent(peers, "complete")
        assert all(p.resyncs >= 1 for p in peers if p is not lossy)
        assert all(p.neighbour_misses <= 1 for p in peers)
    finally:
        close_all(peers)


RING, EXPONENTIAL_16 = 1 / 3, 1 / 8  # W_ii under Metropolis weights: a ring, the exp. graph of 16


@pytest.mark.parametrize(
    ("spec", "self_weight", "gamma"),
    [("none", RING, 1.0), ("fp16", RING, 1.0),
     ("topk:0.01", RING, 0.01**0.85 * 1.5), ("topk:0.01", EXPONENTIAL_16, 0.01**0.85 * 8 / 7),
     ("topk:0.1", RING, 0.1**0.5 / 2),  # √δ/2 is the smaller bound
     ("topk:0.01+qsgd:16", RING, 0.05),  # (1 + ω)^0.75 lifts the graph's bound to √δ/2
     ("topk:0.01+qsgd:16", EXPONENTIAL_16, 0.01**0.85 * 8 / 7 * (1 + 2**0.5) ** 0.75),
     ("qsgd:16", RING, 0.5), ("ternary", EXPONENTIAL_16, 0.5),
     ("sign", RING, 0.5 * (2 / math.pi) ** 0.5),
     ("sign", EXPONENTIAL_16, 0.5 * (2 / math.pi) ** 0.5),
     ("threshold:auto:0.0004+sign", RING, (0.0004 * 2 / math.pi) ** 0.85 * 1.5),
     ("randomk:0.02:noscale", RING, 0.6 * 0.02 * 1.5),  # linear in δ: it keeps no more
     ("randomk:0.02:noscale", EXPONENTIAL_16, 0.6 * 0.02 * 8 / 7),
     ("randomk:0.02:noscale+qsgd:16", RING, 0.6 * 0.02 * 1.5)],  # no (1 + ω)^0.75
)  # fmt: skip
def test_the_automatic_gamma_is_the_smaller_of_half_the_root_and_the_graphs_bound(
    spec: str, self_weight: float, gamma: float
) -> None:
    assert auto_gamma(build_codec(spec), 10**6, self_weight) == pytest.approx(gamma)
    choco = Choco(spec)
    choco.outgoing(torch.zeros(10**6), Round(0, {}, self_weight, resync=True))
    assert choco.gamma == pytest.approx(gamma)
    assert Choco(spec, gamma=0.2).gamma == 0.2  # --gamma overrides


def test_the_automatic_gamma_keeps_choco_stable_where_half_the_root_of_delta_stalls() -> None:
    # Top-1% of 1,000 values on the exponential graph of 8 (W_ii = 1/6): γ* ≈ 0.033, auto 0.024.
    graph = build_topology("exponential", 8)
    assert consensus_spreads("topk:0.01", graph, None, 300)[-1] < 1 / 15  # 0.036
    assert consensus_spreads("topk:0.01", graph, 0.05, 300)[-1] > 1 / 10  # √δ/2: 0.196


def test_the_automatic_gamma_keeps_random_k_stable_where_top_ks_law_diverges() -> None:
    # Random-2% of 1,000 values on a ring of 8: γ* ≈ 0.030; δ^0.85 / (1 − W_ii) gave 0.054.
    graph = build_topology("ring", 8)
    assert consensus_spreads("randomk:0.02:noscale", graph, None, 300)[-1] < 0.5  # 0.34
    assert consensus_spreads("randomk:0.02:noscale", graph, 0.054, 300)[-1] > 2  # 2.7


def test_compressed_broadcast_keeps_every_peer_on_one_model_and_loses_no_update() -> None:
    n, width = 3, 200
    peers = make_swarm(n, "complete", [0.0] * n, width=width, algorithm="broadcast",
                       codec="threshold:auto:0.05+sign")  # fmt: skip
    try:
        randomize(peers)
        updates = {p.id: torch.randn(p.numel, generator=torch.Generator().manual_seed(p.id))
                   for p in peers}  # fmt: skip

        def local_step(peer: Peer) -> None:  # the same "gradient step" every round
            with torch.no_grad():
                flat = torch.cat([q.reshape(-1) for q in peer.model.parameters()])
                torch.nn.utils.vector_to_parameters(flat + 0.01 * updates[peer.id], peer.params)

        run_rounds(peers, RESYNC_LEAD + 2, before=local_step)  # the first resync averages
        agreed = vectors(peers)
        np.testing.assert_allclose(agreed, agreed[[0, 0, 0]], atol=1e-5)
        held_then = torch.stack([p.averager.residual for p in peers]).mean(0).double().numpy()  # type: ignore[attr-defined]
        rounds = 200
        run_rounds(peers, rounds, before=local_step)
        models = vectors(peers)
        np.testing.assert_allclose(models, models[[0, 0, 0]], atol=1e-4)  # one model everywhere
        # Every update arrives, only delayed: x̄ moves by the mean of all updates and of the
        # residual held back when it started, less the mean residual held back now.
        mean_update = 0.01 * rounds * torch.stack(list(updates.values())).mean(0).double().numpy()
        held_back = torch.stack([p.averager.residual for p in peers]).mean(0).double().numpy()  # type: ignore[attr-defined]
        expected = agreed[0] + mean_update + held_then - held_back
        np.testing.assert_allclose(models[0], expected, atol=1e-3)
        assert peers[0].stats()["bytes_sent"] < rounds * 2 * 4 * peers[0].numel / 5
    finally:
        close_all(peers)


def test_an_unbiased_quantizer_is_scaled_by_one_over_one_plus_omega_on_both_ends() -> None:
    """qsgd:4:16 has ω = min(16/4², √16/4) = 1, so CHOCO adds q/2 to x̂ and to every s."""
    spec, numel = "qsgd:4:16", 64
    assert build_codec(spec).omega(numel) == 1.0
    sender, receiver = Choco(spec, seed=3), Choco(spec, seed=9)
    twin = build_codec(spec, seed=3)  # the sender's codec, drawing the same random rounding
    rnd = Round(0, {1: 1 / 3}, 2 / 3, resync=True)
    x0 = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    sender.outgoing(x0, rnd)
    twin.encode(torch.zeros(numel))  # the first round sends zeros: keep the twin in step
    receiver.outgoing(torch.zeros(numel), rnd)
    assert sender.scale == receiver.scale == 0.5
    x1 = x0 + torch.randn(numel, generator=torch.Generator().manual_seed(1))
    s_before = sender.s.clone()  # type: ignore[union-attr]
    payload = sender.outgoing(x1, Round(1, {1: 1 / 3}, 2 / 3))
    q = twin.encode(x1 - x0)[1]
    torch.testing.assert_close(sender.x_hat, x0 + q / 2)
    torch.testing.assert_close(sender.s, s_before + (2 / 3) * q / 2)
    received = receiver.decode(payload, False, numel, torch.device("cpu"))
    torch.testing.assert_close(received, q)  # the wire carries q itself
    s_then = receiver.s.clone()  # type: ignore[union-attr]
    receiver.incoming(
        torch.zeros(numel), Round(1, {0: 1 / 3}, 2 / 3), {0: Arrival(1 / 3, q, 1)}, []
    )
    torch.testing.assert_close(receiver.s, s_then + q / 6)
    assert Choco("topk:0.01").scale == 1.0 and build_codec("topk:0.01+sign").omega(10**6) == 0


@pytest.mark.parametrize(
    ("spec", "needles"),
    [("topk:0.01+ef", ["needs no '+ef'", "x − x̂ is the error memory", "'topk:0.01+delta-golomb'"]),
     ("randomk:0.01", ["not contractive", "'randomk:0.01:noscale'"]),
     ("randomk:0.05+fp16", ["not contractive", "'randomk:0.05:noscale+fp16'"])],
)  # fmt: skip
def test_choco_refuses_error_feedback_and_scaled_random_k_saying_why(
    spec: str, needles: list[str]
) -> None:
    with pytest.raises(ValueError) as caught:
        Choco(spec)
    assert all(n in str(caught.value) for n in needles), caught.value
    Choco("randomk:0.01:noscale")  # the contractive form is welcome


@pytest.mark.parametrize(
    "codec", ["topk:0.01", "randomk:0.1:noscale+fp16", "threshold:auto", "powersgd:1"]
)
def test_dense_gossip_refuses_a_sparsifier_saying_why(codec: str) -> None:
    """Dense gossip sends the model itself: a sparsified one is mostly zeros, which every
    average would pull the models towards (and a defence's stale test read as a frozen
    model), and a low-rank one its top directions alone (two equal models went to rank 1).
    The config names the algorithm to use instead; a quantizer is welcome."""
    from gossipdl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"algorithm = 'dense': .*use algorithm choco") as err:
        load_config(None, algorithm="dense", codec=codec, defence="clip")
    assert f"codec {codec!r}" in str(err.value)
    assert load_config(None, algorithm="dense", codec="qsgd:16").codec == "qsgd:16"
    assert load_config(None, codec=codec).codec == codec  # auto: CHOCO


def test_a_consensus_step_for_an_algorithm_without_one_is_refused() -> None:
    """Dense gossip, broadcast, gossip learning and the ring and parameter-server modes
    take no γ: it was dropped without a word."""
    from gossipdl.averaging import build_averager
    from gossipdl.config import ConfigError, load_config

    for changes in ({"algorithm": "dense"}, {"algorithm": "gossip-learning"}, {}):  # auto: dense
        with pytest.raises(ConfigError, match=r"gamma = 0.5: algorithm '[a-z-]+' takes no"):
            load_config(None, gamma=0.5, **changes)
    with pytest.raises(ConfigError, match="mode 'ring' takes no consensus step"):
        load_config(None, gamma=0.5, mode="ring")
    with pytest.raises(ValueError, match="algorithm 'broadcast' takes no consensus step"):
        build_averager("broadcast", "topk:0.1", gamma=0.5)
    assert load_config(None, gamma=0.5, codec="topk:0.1").gamma == 0.5  # auto: CHOCO


@pytest.mark.parametrize("method", [Choco, Beer, PowerGossip])
@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5])
def test_a_consensus_step_outside_0_to_1_is_refused_naming_the_method(
    method: type[Choco] | type[Beer] | type[PowerGossip], gamma: float
) -> None:
    with pytest.raises(ValueError, match=rf"gamma = {gamma}; \w+ needs 0 < gamma <= 1") as caught:
        method("powersgd:1" if method is PowerGossip else "topk:0.01", gamma=gamma)
    assert {Choco: "CHOCO", Beer: "BEER", PowerGossip: "PowerGossip"}[method] in str(caught.value)
    assert method("powersgd:1" if method is PowerGossip else "topk:0.01", gamma=1.0).gamma == 1.0
