"""Byzantine robustness, the math: each defence bounds what one bad neighbour can do with a
known bad vector, and each attack is what its paper describes."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipdl.averaging import attacks, robust
from gossipdl.rundir import RunDir


def _swarm(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A peer's model and four honest neighbours' near it (dimension 50)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(50, generator=g)
    return x, x + 0.1 * torch.randn(4, 50, generator=g)


BAD = (
    ("blown up", lambda x: 1e6 * x),
    ("sign flip", lambda x: -x),
    ("far away", lambda x: x + 1e3),
)


@pytest.mark.parametrize(("name", "make_bad"), BAD, ids=[b[0] for b in BAD])
def test_clipping_bounds_one_bad_neighbour_by_its_weight_times_an_honest_distance(
    name: str, make_bad: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """With the radius chosen for one bad neighbour, the result moves from plain gossip
    over the honest neighbours (the bad one's weight left on the peer) by at most the bad
    weight times the largest honest distance, whatever the bad vector."""
    x, honest = _swarm()
    bad = make_bad(x)
    neighbours = torch.cat([honest, bad.unsqueeze(0)])
    weights = torch.full((5,), 0.15)
    out = robust.clipped_mix(x, neighbours, weights, self_weight=0.25, bad=1)
    honest_only = x * (0.25 + 0.15) + (honest * 0.15).sum(0)
    largest = float(robust.distances(x, honest).max())
    assert float(torch.linalg.vector_norm(out - honest_only)) <= 0.15 * largest + 1e-5
    plain = x * 0.25 + (neighbours * 0.15).sum(0)  # what plain gossip makes of it
    assert float(torch.linalg.vector_norm(plain - honest_only)) > 10 * 0.15 * largest


def test_clipping_counts_the_share_of_a_pull_it_clipped_away() -> None:
    """What clipping sets aside of a neighbour is ``1 − τ/‖x_j − x‖``: 0 within the radius,
    nearly all of a blown-up model (eviction counts a round against it from one half)."""
    x = torch.zeros(3)
    neighbours = torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [8.0, 0, 0]])
    weights = torch.full((3,), 0.25, dtype=torch.float64)
    _, gaps, aside, _ = robust.Defence("clip", 1).judge(x, neighbours, weights, 0.25)
    torch.testing.assert_close(gaps, torch.tensor([1.0, 2.0, 8.0], dtype=torch.float64))
    torch.testing.assert_close(aside, torch.tensor([0.0, 0.0, 0.75], dtype=torch.float64))


def test_clipping_with_a_radius_past_every_distance_is_plain_gossip() -> None:
    x, honest = _swarm(1)
    weights = torch.tensor([0.2, 0.2, 0.2, 0.2])
    out = robust.clipped_mix(x, honest, weights, self_weight=0.2, radius=1e9)
    torch.testing.assert_close(out, x * 0.2 + (honest * 0.2).sum(0))
    assert robust.auto_radius(torch.tensor([3.0, 1.0, 2.0]), bad=1) == 2.0
    assert robust.auto_radius(torch.tensor([3.0]), bad=1) == 0.0  # nobody to trust


@pytest.mark.parametrize(("name", "make_bad"), BAD, ids=[b[0] for b in BAD])
def test_trimmed_mean_and_median_stay_between_honest_values(
    name: str, make_bad: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    x, honest = _swarm(2)
    neighbours = torch.cat([honest, make_bad(x).unsqueeze(0)])
    values = torch.cat([x.unsqueeze(0), honest])
    low, high = values.min(0).values, values.max(0).values
    rules = (robust.trimmed_mean(x, neighbours, trim=1), robust.coordinate_median(x, neighbours))
    for out in rules:
        assert bool(((out >= low - 1e-6) & (out <= high + 1e-6)).all())
    with pytest.raises(ValueError, match="more than 2·trim"):
        robust.trimmed_mean(x, neighbours[:1], trim=1)


def test_balance_lets_the_odd_peer_back_by_the_median_only_while_it_hears_most() -> None:
    """A peer far from every neighbour (a stale model, or an honest outlier of skewed
    shards) is beyond γ‖x‖ of all of them: it accepts those within twice the median
    distance and moves most of the way to them in one round. Not without ``majority``
    (some neighbours unheard or set aside, so liars may be most of what arrived), and not
    one beyond twice the median: a liar far from the rest stays out."""
    torch.manual_seed(0)
    swarm = torch.randn(100) * 5
    x = swarm + 10.0  # stale: 100 from each of them, γ‖x‖ about 60
    crowd = torch.stack([swarm + 0.1 * torch.randn(100) for _ in range(3)])
    weights = torch.full((3,), 0.25)
    out, accepted = robust.balance(x, crowd, weights, 0.0)
    assert bool(accepted.all())
    torch.testing.assert_close(out, x + (0.25 * (crowd - x)).sum(0))
    assert float((out - crowd.mean(0)).norm()) < 0.3 * float((x - crowd.mean(0)).norm())
    alone, none = robust.balance(x, crowd, weights, 0.0, majority=False)
    assert not bool(none.any())
    torch.testing.assert_close(alone, x)  # γ‖x‖ alone: it keeps its own, as the paper does
    liar = (x + (x - swarm) * 30).unsqueeze(0)  # 3000 away: over twice the median
    out, accepted = robust.balance(x, torch.cat([crowd, liar]), torch.full((4,), 0.2), 0.0)
    assert accepted.tolist() == [True, True, True, False]
    torch.testing.assert_close(out, x + (0.8 / 3 * (crowd - x)).sum(0))  # its weight shared


def test_balance_rejects_a_far_neighbour_and_averages_the_rest() -> None:
    """The far one has no influence: the accepted ones mix with their weights, scaled up to
    carry the rejected one's; accepting everyone is plain gossip."""
    x, honest = _swarm(3)
    neighbours = torch.cat([honest, (x + 1e3).unsqueeze(0)])
    weights = torch.full((5,), 0.15)
    out, accepted = robust.balance(x, neighbours, weights, progress=0.0, gamma=0.5)
    assert accepted.tolist() == [True, True, True, True, False]
    torch.testing.assert_close(out, 0.25 * x + 0.1875 * honest.sum(0))  # 0.75 over four
    everyone, _ = robust.balance(x, honest, weights[:4], progress=0.0, gamma=0.5)
    torch.testing.assert_close(everyone, x + 0.15 * (honest - x).sum(0))  # plain gossip
    late, late_accepted = robust.balance(
        x, honest * 1.5, weights[:4], progress=1.0, gamma=0.5, majority=False
    )
    assert not bool(late_accepted.any())  # the filter tightens: nobody is close enough
    torch.testing.assert_close(late, x)


@pytest.mark.parametrize("spec", ["balance:0.02", "clip:2"])
def test_only_a_neighbour_far_beyond_the_neighbourhood_counts_towards_eviction(
    spec: str,
) -> None:
    """Two neighbours sit beyond BALANCE's γ‖x‖ (and the clipping radius): one 3x as far as
    the median of the peer and its neighbours (an honest outlier of skewed shards), one 20x
    (a blown-up model). Both are set aside; only the second is evidence. With two
    neighbours the peer's own distance, 0, still gives a median to go by."""
    x = torch.full((100,), 10.0)  # γ‖x‖ = 2; clip:2's radius, the third largest gap, 1
    offsets = (1.0, 1.0, 1.0, 3.0, 20.0)
    neighbours = torch.stack([x + 0.1 * k for k in offsets])  # 1, 1, 1, 3 and 20 away
    defence = robust.parse_defence(spec)
    assert defence is not None
    _, _, aside, evidence = defence.judge(x, neighbours, torch.full((5,), 0.15), 0.25)
    assert aside[3] > 0.5 and aside[4] > 0.5
    assert evidence[:4].tolist() == [0.0] * 4 and evidence[4] > 0.5
    assert robust.outlying(torch.tensor([1.0, 7.0])).tolist() == [False, True]
    assert robust.outlying(torch.tensor([1.0, 5.0])).tolist() == [False, False]


def test_the_median_distance_is_torch_quantiles_to_the_bit() -> None:
    """``median_gap`` works on the host what ``torch.quantile(gaps, 0.5)`` gave before it,
    bit for bit (the rules' thresholds, and so every defended run, stay as they were):
    counts odd and even, values over twelve orders of magnitude, and NaN."""
    draws = torch.Generator().manual_seed(7)
    for count in range(1, 10):
        for _ in range(300):
            scale = 10.0 ** float(torch.randint(-6, 7, (), generator=draws))
            gaps = torch.rand(count, generator=draws, dtype=torch.float64) * scale
            assert robust.median_gap(gaps) == float(gaps.quantile(0.5))
            assert robust.median_gap(gaps.tolist()) == float(gaps.quantile(0.5))
    assert robust.median_gap([1.0, 2.0, 4.0, 8.0]) == 3.0
    assert math.isnan(robust.median_gap([math.nan, 1.0, 2.0, 3.0, 5.0]))  # sorted() gives 2.0


def test_balance_with_rho_rejects_a_neighbour_that_far_beyond_the_median_one() -> None:
    """``balance:GAMMA:RHO``: a neighbour RHO times as far as the median neighbour is rejected
    though well inside γ‖x‖ (a model trained on flipped labels, on iid shards), but that
    counts for nothing towards evicting it (an honest outlier of non-IID shards draws it
    too); without RHO it counts. Two neighbours have no median to go by, so both count; two
    of four that hold the peer's own model do not make the median 0."""
    x = torch.full((100,), 10.0)  # γ‖x‖ = 50
    near = torch.stack([x + 0.1 * k for k in (1.0, 1.1, 0.9)])  # 1.0, 1.1, 0.9 away
    neighbours = torch.cat([near, (x + 0.25).unsqueeze(0)])  # 2.5 away: 2.4x the median
    weights = torch.full((4,), 0.2)
    judged = {}
    for spec in ("balance", "balance:0.5:2", "balance:0.5:3"):
        defence = robust.parse_defence(spec)
        assert defence is not None
        _, gaps, aside, evidence = defence.judge(x, neighbours, weights, 0.2)
        judged[spec] = aside.tolist()
        assert evidence.tolist() == [0.0] * 4  # RHO's rejection is no ground for eviction
    expected = torch.tensor([1.0, 1.1, 0.9, 2.5], dtype=torch.float64)
    torch.testing.assert_close(gaps, expected, rtol=1e-5, atol=0)
    assert judged == {
        "balance": [0.0] * 4,
        "balance:0.5:2": [0.0, 0.0, 0.0, 1.0],
        "balance:0.5:3": [0.0] * 4,
    }
    two = robust.parse_defence("balance:0.5:2")
    assert two is not None
    assert two.judge(x, neighbours[2:], weights[2:], 0.6)[2].tolist() == [0.0, 0.0]
    # two of four that hold the peer's own model cannot shut it in: the median of an even
    # count is the mean of the middle two (halfway to the nearest other one), not zero
    three = robust.parse_defence("balance:0.5:3")
    assert three is not None
    twins = torch.stack([x, x, x + 0.1, x + 0.14])  # 0, 0, 1.0, 1.4 away: limit 1.5
    assert three.judge(x, twins, weights, 0.2)[2].tolist() == [0.0, 0.0, 0.0, 0.0]
    twins[3] = x + 0.16  # 1.6 away
    assert three.judge(x, twins, weights, 0.2)[2].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_a_neighbour_rejected_by_rho_alone_is_never_accused() -> None:
    """Round after round a neighbour 2.5x as far as the median one is set aside by
    ``balance:0.5:2`` (its metrics say so) but never becomes a suspect; one beyond γ‖x‖ is."""
    from gossipdl.averaging import Arrival, Round, build_averager

    x = torch.full((100,), 10.0)  # γ‖x‖ = 50
    for far, suspect in ((0.25, []), (6.0, [4])):  # 2.5 away; 60 away
        averager = build_averager("dense", defence="balance:0.5:2")
        for t in range(6):
            moved = 1e-3 * t  # every model moves, as a live one does
            models = {1: x + 0.1 + moved, 2: x + 0.11 + moved, 3: x + 0.09 + moved,
                      4: x + far + moved}  # fmt: skip
            arrivals = {j: Arrival(0.2, m, t) for j, m in models.items()}
            averager.incoming(x, Round(t, dict.fromkeys(models, 0.2), 0.2), arrivals, [])
        assert averager.metrics()["neighbours"]["4"]["filtered"] == 1.0
        assert averager.suspects(5) == suspect


def test_descent_scores_say_whether_a_neighbour_lies_ahead_along_the_own_update() -> None:
    before = torch.zeros(4)
    update = torch.tensor([0.1, 0.0, 0.0, 0.0])
    models = torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0], [0.0, 2, 0, 0], [1.0, 1, 0, 0]])
    scores = robust.descent_scores(update, before, models)
    torch.testing.assert_close(scores, torch.tensor([1.0, -1.0, 0.0, 0.5**0.5]).double())


def _descending_rounds(
    defence: str, rounds: int, contrary: tuple[int, ...], side: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A peer that steps 0.1 along e0 between rounds, and four neighbours ``side`` off to
    a side each (and moving): those in ``contrary`` also 0.1 behind where the peer's last
    mix left it along e0 (a model trained against the task), the rest 0.1 ahead, level
    with the peer. Its last round's (x, new model, averager)."""
    from gossipdl.averaging import Arrival, Round, build_averager

    averager = build_averager("dense", defence=defence)
    mixed = torch.full((100,), 10.0)  # γ‖x‖ = 50: BALANCE accepts every neighbour
    for t in range(rounds):
        x = mixed.clone()
        x[0] += 0.1  # the own update
        models = {}
        for j in (1, 2, 3, 4):
            offset = torch.zeros(100)
            offset[0] = -0.1 if j in contrary else 0.1
            offset[10 + j] = (0.0 if j in contrary else side) + 1e-3 * t
            models[j] = mixed + offset
        arrivals = {j: Arrival(0.2, m, t) for j, m in models.items()}
        out = averager.incoming(x, Round(t, dict.fromkeys(models, 0.2), 0.2), arrivals, [])
        mixed = out
    return x, out, averager


def test_descent_sets_aside_a_far_neighbour_that_keeps_undoing_the_own_descent() -> None:
    """``balance+descent`` sets aside a neighbour that sits behind the peer along its own
    update round after round, which plain BALANCE accepts (well within γ‖x‖); its running
    score shows in the metrics, and it is never accused (eviction)."""
    x, out, plain = _descending_rounds("balance", 8, contrary=(4,))
    assert out[0] < x[0]  # pulled back along the own descent
    assert plain.metrics()["neighbours"]["4"]["filtered"] == 0.0
    x, out, averager = _descending_rounds("balance+descent", 8, contrary=(4,))
    assert out[0] >= x[0]  # nobody pulls it back
    judged = averager.metrics()["neighbours"]
    assert judged["4"]["descent"] < -robust.DESCENT_TAU < 0 < judged["1"]["descent"]
    assert 0 < judged["4"]["filtered"] < 1  # not in the first rounds: a running score
    assert judged["1"]["filtered"] == 0.0
    assert averager.suspects(2) == []


def test_descent_keeps_a_contrary_neighbour_no_farther_than_the_median_one() -> None:
    """A contrary neighbour nearer than the median one is kept (on non-IID shards honest
    neighbours score as low at times): the rule sees the same models as without."""
    _, out, _ = _descending_rounds("balance", 8, contrary=(4,), side=0.5)
    _, with_descent, averager = _descending_rounds("balance+descent", 8, (4,), side=0.5)
    torch.testing.assert_close(with_descent, out)
    judged = averager.metrics()["neighbours"]
    assert judged["4"]["descent"] < -robust.DESCENT_TAU
    assert all(n["filtered"] == 0.0 for n in judged.values())


def test_balance_allows_the_drift_of_the_steps_since_the_peer_last_mixed() -> None:
    """γ grows as √steps, the steps since the peer last took a neighbour's model in: a
    neighbour 0.8‖x‖ away is rejected one and two steps after that and accepted three
    after it, whether rounds of one step passed in which it was rejected (the peer trained
    alone, as it does through rounds without a sync) or one round of three (periodic:3);
    then rejected again a step later."""
    from gossipdl.averaging import Arrival, Averager, Round, build_averager

    x = torch.ones(100)
    x_norm = float(torch.linalg.vector_norm(x))
    direction = torch.zeros(100)
    direction[0] = 1.0

    def accepted(index: int, period: int, averager: Averager) -> bool:
        far = x + (0.8 * x_norm + 1e-3 * index) * direction  # it moves, as a live one does
        rnd = Round(index, {1: 0.5}, 0.5, period=period)
        out = averager.incoming(x, rnd, {1: Arrival(0.5, far, index)}, [])
        return not torch.equal(out, x)

    every_step = build_averager("dense", defence="balance")
    assert not accepted(0, 1, every_step) and not accepted(1, 1, every_step)
    assert accepted(2, 1, every_step)  # three steps alone: 0.5·√3 > 0.8
    assert not accepted(3, 1, every_step)  # and then one again
    assert accepted(6, 1, every_step)  # two rounds without a sync, one rejected
    periodic = build_averager("dense", defence="balance")
    assert accepted(0, 3, periodic) and accepted(1, 3, periodic)
    assert not accepted(2, 1, periodic)


def test_alie_sits_z_standard_deviations_inside_the_honest_spread() -> None:
    x, honest = _swarm(4)
    z = attacks.alie_z(16, 2)
    assert z == pytest.approx(0.1573, abs=1e-4)  # Φ(z) = (16 − s)/16, s = ⌊16/2 + 1⌋ − 2
    assert attacks.alie_z(50, 24) == pytest.approx(1.75, abs=0.01)  # the paper's n = 50 row
    sent = attacks.alie(x, honest, z)
    models = torch.cat([x.unsqueeze(0), honest])
    mean, std = models.mean(0), models.std(0)
    torch.testing.assert_close((mean - sent) / std, torch.full_like(mean, z))


def test_inner_product_manipulation_points_against_the_honest_mean() -> None:
    x, honest = _swarm(5)
    sent = attacks.inner_product_manipulation(x, honest, epsilon=0.1)
    mean = torch.cat([x.unsqueeze(0), honest]).mean(0)
    assert float(sent @ mean) == pytest.approx(-0.1 * float(mean @ mean), rel=1e-5)


def test_dissensus_cancels_then_reverses_the_honest_pull_under_plain_gossip() -> None:
    """The victim mixes with weight 0.2 on itself, 0.2 on each of three honest neighbours
    and 0.2 on the attacker: with ε = 1 it stays where it is; with ε = 2 it moves away
    from its honest neighbours' mean."""
    victim, honest = _swarm(6)
    honest = honest[:3]
    weights = torch.full((3,), 0.2)
    for epsilon, moved in ((1.0, 0.0), (2.0, None)):
        sent = attacks.dissensus(victim, honest, weights, 0.2, epsilon)
        mixed = victim * 0.2 + (honest * 0.2).sum(0) + sent * 0.2
        target = honest.mean(0)
        before = float(torch.linalg.vector_norm(victim - target))
        after = float(torch.linalg.vector_norm(mixed - target))
        if moved == 0.0:
            torch.testing.assert_close(mixed, victim)
        else:
            assert after > before


def test_the_crude_attacks_and_flipped_labels() -> None:
    x, _ = _swarm(7)
    torch.testing.assert_close(attacks.sign_flip(x), -x)
    torch.testing.assert_close(attacks.scaled(x, 100.0), 100 * x)
    noisy = attacks.gaussian(x, 2.0, torch.Generator().manual_seed(0))
    assert float((noisy - x).std()) == pytest.approx(2.0, rel=0.3)
    labels = torch.tensor([0, 3, 9])
    assert attacks.flip_labels(labels, 10).tolist() == [9, 6, 0]
    assert torch.equal(attacks.flip_labels(attacks.flip_labels(labels, 10), 10), labels)


def test_dense_gossip_with_a_defence_keeps_a_bad_neighbours_model_out() -> None:
    """The averager as peers build it: a blown-up model among three arrivals moves plain
    dense gossip far and each defence hardly at all."""
    from gossipdl.averaging import Arrival, Round, build_averager

    x, honest = _swarm(8)
    arrivals = {j: Arrival(0.2, v, 0) for j, v in enumerate(honest[:3], start=1)}
    arrivals[4] = Arrival(0.2, 1e6 * x, 0)
    rnd = Round(0, {j: 0.2 for j in range(1, 5)}, 0.2)
    honest_mean = torch.cat([x.unsqueeze(0), honest[:3]]).mean(0)
    plain = build_averager("dense").incoming(x, rnd, arrivals, [])
    assert float(torch.linalg.vector_norm(plain - honest_mean)) > 1e4
    for defence in ("clip", "trimmed", "median", "balance"):
        averager = build_averager("dense", defence=defence)
        for r in range(3):  # every model moves a little each round, as a live one does
            moved = {j: Arrival(0.2, a.value + 1e-4 * r, 0) for j, a in arrivals.items()}
            out = averager.incoming(x, rnd, moved, [])
        assert float(torch.linalg.vector_norm(out - honest_mean)) < 1.0, defence
        # detection: the bad one stands out in the peer's metrics
        judged = averager.metrics()["neighbours"]
        assert set(judged) == {"1", "2", "3", "4"} and judged["4"]["rounds"] == 3
        honest_aside = max(judged[j]["filtered"] for j in "123")  # a median sets most aside
        assert judged["4"]["filtered"] > 0.9 and judged["4"]["filtered"] > honest_aside
        assert judged["4"]["distance"] > 1e4 * max(judged[j]["distance"] for j in "123")
    assert build_averager("dense").metrics() == {}  # no defence, no such key
    # neighbours missing, too few values left to outvote a bad one: the peer keeps x (a lone
    # liar, averaged in at half the weight before, moved it by 5e5 times its length)
    lone = {4: arrivals[4]}
    for defence in ("trimmed", "trimmed:2", "median", "clip", "balance"):
        averager = build_averager("dense", defence=defence)
        torch.testing.assert_close(averager.incoming(x, rnd, lone, [1, 2, 3]), x)
        assert averager.metrics()["neighbours"]["4"]["filtered"] == 1.0, defence
    # enough values again: a trimmed mean of three is their median
    two = {j: arrivals[j] for j in (1, 4)}
    kept = build_averager("dense", defence="trimmed").incoming(x, rnd, two, [2, 3])
    torch.testing.assert_close(kept, torch.stack([x, honest[0], arrivals[4].value]).median(0)[0])


def test_a_defended_peer_sets_aside_a_neighbour_whose_model_stopped_moving() -> None:
    """A crashed neighbour replays its model: from its second message on, every defence
    leaves it out (its weight shared among the fresh ones) and counts it as set aside."""
    from gossipdl.averaging import Arrival, Round, build_averager

    x, honest = _swarm(8)
    frozen = x + 5.0  # far enough to pull, close enough for clipping to let it in
    rnd = Round(0, {1: 0.25, 2: 0.25, 3: 0.25}, 0.25)
    for defence in ("clip", "trimmed", "median", "balance"):
        averager = build_averager("dense", defence=defence)
        for r in range(4):
            arrivals = {
                1: Arrival(0.25, honest[0] + 1e-3 * r, r),
                2: Arrival(0.25, honest[1] - 1e-3 * r, r),
                3: Arrival(0.25, frozen, r),
            }
            out = averager.incoming(x, rnd, arrivals, [])
        without = build_averager("dense", defence=defence).incoming(
            x, Round(0, {1: 0.375, 2: 0.375}, 0.25),
            {j: replace(arrivals[j], weight=0.375) for j in (1, 2)}, [],
        )  # fmt: skip
        torch.testing.assert_close(out, without)  # the stale one counts for nothing
        judged = averager.metrics()["neighbours"]
        assert judged["3"]["filtered"] >= 0.75 and judged["3"]["rounds"] == 4, defence


def test_a_defence_is_named_and_checked_in_the_config() -> None:
    from gossipdl.config import ConfigError, load_config

    assert load_config(None, defence="clip:2", topology="complete").defence == "clip:2"
    assert robust.parse_defence("balance:0.3") == robust.Defence("balance", 0.3)
    assert robust.parse_defence("balance::2") == robust.Defence("balance", 0.5, 2.0)
    assert robust.parse_defence("clip+descent:0.2") == robust.Defence("clip", 1.0, 0.0, 0.2)
    assert robust.parse_defence("median+descent").descent == robust.DESCENT_TAU
    for bad, says in (
        ("clip:1.5", "count"),
        ("balance:0.5:0.8", "RHO is 0, off, or at least 1"),
        ("clip:1:2", "use one of"),
        ("median:3", "use one of"),
        ("shield", "use one of"),
        ("balance+descent:0", "a cosine in"),
        ("balance+descent:1.5", "a cosine in"),
        ("balance+desc", "use one of"),
        ("none+descent", "goes after a rule"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, defence=bad)
    with pytest.raises(ConfigError, match="use algorithm dense, choco or beer"):
        load_config(None, defence="clip", algorithm="powergossip", codec="powersgd:1")
    for algorithm in ("choco", "beer"):  # public copies
        load_config(None, defence="clip", algorithm=algorithm, codec="topk:0.1")
    with pytest.raises(ConfigError, match="mode 'ring'"):
        load_config(None, defence="median", mode="ring")


@pytest.mark.parametrize(
    ("topology", "defence", "says"),
    [
        ("star", "clip", "a peer there has 1 neighbour, and clipping for 1 bad neighbour"),
        ("star", "trimmed", "has 1 neighbour, and a trimmed mean of TRIM 1"),
        ("star", "median+descent", "has 1 neighbour, and the median"),
        ("one-peer-exponential", "clip", "has 1 neighbour a round"),
        ("one-peer-exponential", "median", "has 1 neighbour a round"),
        ("ring", "clip:2", "has 2 neighbours, .* only with 3 or more, .* use clip:1, defence bal"),
        ("ring", "trimmed:2", "only with 4 or more, .* use trimmed:1, defence balance"),
        ("torus", "trimmed:2", "has 3 neighbours"),  # 2x4: three neighbours a peer
    ],
)
def test_a_defence_that_could_never_mix_on_the_graph_is_refused(
    topology: str, defence: str, says: str
) -> None:
    """A peer with too few neighbours for its rule keeps its own model every round (clipping's
    radius is 0, the coordinate-wise rules too few values): 8 peers on a star or the one-peer
    exponential graph ended 4.69 apart, plain gossip 0.002. Refused before any peer starts;
    BALANCE, and the same rules on denser graphs, are not."""
    from gossipdl.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=re.escape(f"defence = {defence!r} on topology = {topology!r}")
    ):
        load_config(None, peers=8, topology=topology, defence=defence)
    with pytest.raises(ConfigError, match=says):
        load_config(None, peers=8, topology=topology, defence=defence)
    load_config(None, peers=8, topology=topology, defence="balance")
    load_config(None, peers=8, topology="exponential", defence=defence)  # 4 neighbours or more


def test_a_median_of_three_on_a_ring_is_cautioned_before_the_run() -> None:
    """With two neighbours the median and a trimmed mean of TRIM 1 take the median of three
    models, which has fixed points apart: a warning names it before the run; not on graphs
    of three neighbours or more, nor for clipping."""
    from gossipdl.config import cautions, load_config

    for defence in ("median", "trimmed", "trimmed:1+descent"):
        (text,) = cautions(load_config(None, peers=8, topology="ring", defence=defence))
        assert "median of three models" in text and "defence clip or balance" in text
    for topology, defence in (("exponential", "median"), ("ring", "clip"), ("torus", "trimmed")):
        assert cautions(load_config(None, peers=8, topology=topology, defence=defence)) == []


def test_every_attack_of_the_swarm_is_checked_in_the_config() -> None:
    """Two liars with different attacks: the second one's is checked too (dissensus on CHOCO
    crashed at run time behind a scaled liar). ALIE's z, from how many are honest, cannot be
    worked out when every peer lies (it crashed at run time): refused, not with a z given."""
    from gossipdl.config import ConfigError, load_config

    two = {
        "a": {"peers": "0", "byzantine": "scaled"},
        "b": {"peers": "3", "byzantine": "dissensus"},
    }
    with pytest.raises(ConfigError, match="byzantine 'dissensus' sends each neighbour"):
        load_config(None, peers=6, algorithm="choco", codec="topk:0.1", profiles=two)
    load_config(None, peers=6, profiles=two)  # dense gossip takes both

    def everyone(spec: str) -> dict[str, Any]:
        return {"a": {"peers": "*", "byzantine": spec}}

    with pytest.raises(ConfigError, match=r"byzantine 'alie' on all 4 peers; .* give z"):
        load_config(None, peers=4, profiles=everyone("alie"))
    load_config(None, peers=4, profiles=everyone("alie:1"))
    load_config(None, peers=4, profiles={"a": {"peers": "0-2", "byzantine": "alie"}})


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("ipm:-1", "ipm's ε is -1; give one above 0"),
        ("ipm:0", "ipm's ε is 0; give one above 0, e.g. the default ipm:0.1"),
        ("dissensus:-2", "dissensus's ε is -2"),
        ("dissensus:0", "dissensus's ε is 0"),
        ("gaussian:-1", "gaussian's σ is -1"),
        ("gaussian:0", "gaussian's σ is 0"),
    ],
)
def test_an_attack_number_of_the_wrong_sign_is_refused(spec: str, says: str) -> None:
    """ε <= 0 makes IPM and dissensus no attack (or a help), σ <= 0 is no noise: refused with
    the number's name and the default; the config says so before any peer starts."""
    from gossipdl.config import ConfigError, load_config

    with pytest.raises(ValueError, match=says):
        attacks.parse_attack(spec)
    with pytest.raises(ConfigError, match=says):
        load_config(None, profiles={"a": {"peers": "0", "byzantine": spec}})
    for fine in ("ipm:0.5", "dissensus:1", "gaussian:2", "scaled:-3", "alie:-1"):
        attacks.parse_attack(fine)


def test_alie_without_a_z_is_refused_where_nothing_works_it_out() -> None:
    """A peer built with ``Attack('alie', None)`` (``gossipdl.Peer``, ``build_averager``)
    sent the crowd's plain mean, z being 0: it must be given a z."""
    from gossipdl.averaging import build_averager

    with pytest.raises(ValueError, match="byzantine 'alie' has no z here"):
        build_averager("dense", attack=attacks.parse_attack("alie"))
    liar = build_averager("dense", attack=attacks.Attack("alie", attacks.alie_z(16, 2)))
    assert liar.attack.param == pytest.approx(0.157, abs=1e-3)  # type: ignore[attr-defined]


def test_a_simulated_swarm_trains_under_every_defence(tmp_path: Path) -> None:
    """With no attack, each defence still trains the swarm and pulls its models together:
    eight batched simulated peers on a ring, accuracy within 5 points of plain
    dense gossip, and the final models' spread a third or less of peers that never talk
    (coordinate-wise rules over a ring's three values contract least)."""
    from conftest import small_config

    from gossipdl.experiments.simulated import simulate

    results = {}
    for defence in ("alone", "none", "clip", "trimmed", "median", "balance"):
        config = small_config(
            tmp_path / defence, peers=8, topology="ring", steps=80, eval_every=0,
            defence="none" if defence == "alone" else defence, batched=True,
            trigger="periodic:1000" if defence == "alone" else "always",
        )  # fmt: skip
        results[defence] = simulate(config, step_time=0.01)
    alone = results.pop("alone")["consensus_distance"]
    accuracy = {d: r["mean_accuracy"] for d, r in results.items()}
    assert accuracy["none"] > 0.6 and min(accuracy.values()) >= accuracy["none"] - 0.05, accuracy
    for defence, result in results.items():
        assert result["consensus_distance"] < alone / 3, (defence, result["consensus_distance"])
    last = list(RunDir(tmp_path / "clip" / "run").records(0))[-1]
    assert set(last["neighbours"]) == {"1", "7"}  # peer 0's ring neighbours, judged
    assert "neighbours" not in list(RunDir(tmp_path / "none" / "run").records(0))[-1]


def _honest_accuracy(summary: dict, byzantine: set[int]) -> float:
    honest = [p["accuracy"] for p in summary["peers"] if p["id"] not in byzantine]
    return sum(honest) / len(honest)


def test_a_byzantine_peer_wrecks_plain_gossip_and_clipping_holds_it_off(tmp_path: Path) -> None:
    """Eight simulated peers on a ring, peer 3 Byzantine: a blown-up model (scaled ×100)
    and the dissensus attack take plain dense gossip's honest peers below 50%; with
    clipping they stay within 2 points of the attack-free run. Batched, but for the swarm
    the blown-up model wrecks: its neighbours drop the non-finite messages, per peer."""
    from conftest import small_config

    from gossipdl.experiments.simulated import simulate

    def run(name: str, attack: str | None, defence: str) -> float:
        profiles = {"liar": {"peers": "3", "byzantine": attack}} if attack else {}
        config = small_config(
            tmp_path / name, peers=8, topology="ring", steps=80, defence=defence,
            profiles=profiles, batched=name != "scaled-plain",
        )  # fmt: skip
        return _honest_accuracy(simulate(config, step_time=0.01), {3})

    clean = run("clean", None, "clip")
    for attack in ("scaled", "dissensus"):
        assert run(f"{attack}-plain", attack, "none") < 0.5, attack
        assert run(f"{attack}-clip", attack, "clip") >= clean - 0.02, attack


def test_a_byzantine_averager_sends_what_its_attack_makes_of_its_model() -> None:
    from gossipdl.averaging import Arrival, Round
    from gossipdl.averaging.attacks import parse_attack
    from gossipdl.averaging.byzantine import ByzantineGossip
    from gossipdl.averaging.dense import DenseGossip

    x, honest = _swarm(9)
    rnd = Round(1, {1: 0.25, 2: 0.25, 3: 0.25}, 0.25)
    seen = {j: Arrival(0.25, honest[j - 1], 0) for j in (1, 2, 3)}

    def sent(spec: str) -> object:
        liar = ByzantineGossip(parse_attack(spec))
        liar.incoming(x, rnd, seen, [])  # it learns what its neighbours sent
        return liar.outgoing(x, rnd)

    def model(payload: object) -> torch.Tensor:
        return DenseGossip().decode(payload, False, 50, torch.device("cpu"))  # type: ignore[arg-type]

    torch.testing.assert_close(model(sent("scaled:3")), 3 * x)
    torch.testing.assert_close(model(sent("sign-flip")), -x)
    crowd = honest[:3]
    ipm = attacks.inner_product_manipulation(x, crowd, 0.5)
    torch.testing.assert_close(model(sent("ipm:0.5")), ipm)
    torch.testing.assert_close(model(sent("alie:1.0")), attacks.alie(x, crowd, 1.0))
    per_neighbour = sent("dissensus:1.0")
    assert isinstance(per_neighbour, dict) and sorted(per_neighbour) == [1, 2, 3]
    victim = model(per_neighbour[1])  # cancels the others' pull on neighbour 1 (ε = 1)
    expected = attacks.dissensus(honest[0], honest[1:3], torch.tensor([0.25, 0.25]), 0.25, 1.0)
    torch.testing.assert_close(victim, expected)
    stale = ByzantineGossip(parse_attack("stale"))
    first = model(stale.outgoing(x, rnd))
    torch.testing.assert_close(model(stale.outgoing(x + 1, rnd)), first)  # frozen for good


def test_real_peers_with_clipping_shrug_off_a_byzantine_peer_process(tmp_path: Path) -> None:
    """Four real peer processes on a ring, peer 1 sends its model blown up ×100 over real
    sockets; with clipping the honest three train as without it, and their metrics name
    peer 1 as the neighbour set aside."""
    check_clipping_shrugs_off_a_byzantine_peer_process(tmp_path)


def check_clipping_shrugs_off_a_byzantine_peer_process(tmp_path: Path, device: str = "cpu") -> None:
    """The real-process clipping check, its peers on ``device``; every peer's final line
    names a device of that type."""
    from conftest import small_config

    from gossipdl.experiments.launcher import launch

    config = small_config(
        tmp_path, peers=4, topology="ring", steps=60, defence="clip", device=device,
        profiles={"liar": {"peers": "1", "byzantine": "scaled"}},
    )  # fmt: skip
    summary = launch(config, progress=False)
    assert summary["peers_finished"] == 4
    assert _honest_accuracy(summary, {1}) > 0.8, summary["peers"]
    run = RunDir(config.out)
    judged = list(run.records(0))[-1]["neighbours"]
    assert judged["1"]["filtered"] > 0.9 > 0.1 > judged["3"]["filtered"], judged
    kind = "cpu" if device == "cpu" else "cuda"
    assert all(list(run.records(i))[-1]["device"].startswith(kind) for i in range(4))


def _rounds(
    averager: Any, x: torch.Tensor, copies: dict[int, Any], updates: dict[int, Any]
) -> torch.Tensor:
    """A resync round that gives ``averager`` (a CHOCO or BEER peer, neighbours 1-3 at 0.25
    each) the neighbours' public ``copies`` (BEER's: :class:`~gossipdl.averaging.beer.Pair`s
    of model and tracker), then a round in which they send ``updates``; the model the
    gossip step after them leaves (CHOCO's in that round's incoming, BEER's in the next
    round's outgoing, a round in which nothing arrives). The peer's own model stays ``x``."""
    from gossipdl.averaging import Arrival, Beer, Round

    weights = {j: 0.25 for j in copies}
    rounds = [Round(t, weights, 0.25, resync=t == 0, lr=0.1) for t in range(3)]
    averager.outgoing(x, rounds[0])
    dense = {j: Arrival(0.25, v, 0, dense=True) for j, v in copies.items()}
    averager.incoming(x, rounds[0], dense, [])
    averager.outgoing(x, rounds[1])
    arrived = {j: Arrival(0.25, q, 1) for j, q in updates.items()}
    out = averager.incoming(x, rounds[1], arrived, [])
    if isinstance(averager, Beer):
        averager.outgoing(x, rounds[2])
        out = averager.incoming(x, rounds[2], {}, [])
    return out  # type: ignore[no-any-return]


def test_choco_with_a_defence_bounds_a_bad_neighbours_public_copy() -> None:
    """CHOCO mixes public copies, which a Byzantine neighbour steers with its updates: one
    update of 1e6·x moves plain CHOCO's model by about γ·W·1e6‖x‖, and with each defence
    by no more than γ times the honest neighbours' pull (each coordinate's largest honest
    offset), and the metrics name it: set aside in the round it went bad."""
    from gossipdl.averaging import Round, build_averager

    x, honest = _swarm(11)
    copies = {j: honest[j - 1] for j in (1, 2, 3)}
    small = {j: 1e-3 * torch.ones(50) for j in (1, 2)}
    updates = small | {3: 1e6 * x}
    plain = build_averager("choco", "topk:0.5", gamma=0.5)
    moved = float(torch.linalg.vector_norm(_rounds(plain, x, copies, updates) - x))
    assert moved > 1e3  # γ·W·1e6‖x‖ at the warm-up's share of γ
    envelope = (honest[:3] - x).abs().max(0).values  # plus the honest updates' 1e-3
    honest_pull = float(torch.linalg.vector_norm(envelope)) + 0.01
    for defence in ("clip", "trimmed", "median", "balance"):
        averager = build_averager("choco", "topk:0.5", gamma=0.5, defence=defence)
        out = _rounds(averager, x, copies, updates)
        step = averager.step_size(Round(1, {}, 0.25))  # type: ignore[attr-defined]
        assert float(torch.linalg.vector_norm(out - x)) <= step * honest_pull, defence
        judged = averager.metrics()["neighbours"]
        honest_aside = max(judged[j]["filtered"] for j in "12")  # rounds 0 (resync) and 1
        assert judged["3"]["filtered"] > 0.49 and judged["3"]["filtered"] > honest_aside
        assert judged["3"]["distance"] > 1e4 * judged["1"]["distance"], defence


def test_a_defended_peer_sets_aside_a_public_copy_whose_finite_updates_overflow() -> None:
    """Every update a liar sends is finite (the wire refuses others), but in its neighbours'
    copies of it they add up past float32's range: each defence sets such a copy aside
    (clipping and BALANCE turned its ``0 · inf`` into NaN), and copies mixed by weight
    alone (BEER's trackers, which no rule judges) leave it out."""
    from gossipdl.averaging import Round, build_averager
    from gossipdl.averaging.replicas import Replicas
    from gossipdl.compression.sparse import SparseVector

    x, honest = _swarm(13)
    huge, tiny = torch.full((50,), 3e38), 1e-3 * torch.ones(50)
    copies = {j: honest[j - 1] for j in (1, 2)} | {3: huge}
    updates = {1: tiny, 2: -tiny, 3: huge}
    for defence in ("clip", "trimmed", "median", "balance"):
        averager = build_averager("choco", "topk:0.5", gamma=0.5, defence=defence)
        out = _rounds(averager, x, copies, updates)
        assert bool(torch.isfinite(out).all()), defence
        assert averager.metrics()["neighbours"]["3"]["filtered"] >= 0.5, defence
    # BEER's trackers are mixed by weight (Replicas without a judge): an overflowed copy,
    # dense or sparse updates, is left out until a resync rebuilds it
    for sparse in (False, True):
        trackers = Replicas()
        trackers.rebuild({j: copies[j] for j in (1, 2)} | {3: honest[2]})
        for _ in range(3):
            update = SparseVector(torch.arange(50), huge, 50) if sparse else huge
            trackers.add(3, update, 1.0)
            trackers.add(1, tiny, 1.0)
        rnd = Round(1, {1: 0.25, 2: 0.25, 3: 0.25}, 0.25)
        mixed = trackers.combine(x, rnd)
        assert trackers.broken == {3} and bool(torch.isfinite(mixed).all()), sparse
        torch.testing.assert_close(mixed, 0.5 * x + 0.25 * (copies[1] + 3 * tiny + copies[2]))
        trackers.rebuild({j: copies[j] for j in (1, 2)} | {3: honest[2]})
        assert trackers.broken == set()


def test_descent_judges_a_public_copy_by_its_own_move_not_by_the_pull() -> None:
    """With CHOCO the judge sees public copies and returns a pull: ``+descent`` measures the
    peer's own move as its copy's. A peer that trains not at all, its neighbours on one
    side of it, follows the pull towards them, so no neighbour undoes its descent and
    ``+descent`` sets aside nothing the rule alone does not (measured from the last pull,
    the far ones were set aside in 37-79% of rounds)."""
    from gossipdl.averaging import Arrival, Round, build_averager

    def judged(defence: str) -> dict[str, Any]:
        averager = build_averager("choco", "topk:0.5", gamma=0.5, defence=defence)
        x = torch.zeros(100)
        copies = {}
        for j, side in zip((1, 2, 3, 4), (1.0, 1.1, 1.2, 1.6), strict=True):
            copies[j] = torch.zeros(100)
            copies[j][0], copies[j][10 + j] = side, 0.3
        for t in range(30):
            rnd = Round(t, dict.fromkeys(copies, 0.2), 0.2, resync=t == 0, lr=1.0)
            averager.outgoing(x, rnd)
            if t == 0:
                arrived = {j: Arrival(0.2, v.clone(), 0, dense=True) for j, v in copies.items()}
            else:  # each neighbour's copy moves a little, as a live model's does
                moves = {j: torch.zeros(100) for j in copies}
                for j, q in moves.items():
                    q[20 + j] = 0.05 * (-1) ** t
                arrived = {j: Arrival(0.2, q, t) for j, q in moves.items()}
            x = averager.incoming(x, rnd, arrived, [])
        return averager.metrics()["neighbours"]  # type: ignore[no-any-return]

    for rule in ("clip", "balance"):
        alone, scored = judged(rule), judged(f"{rule}+descent")
        assert all(n["descent"] > -robust.DESCENT_TAU for n in scored.values()), rule
        assert {j: n["filtered"] for j, n in scored.items()} == {
            j: n["filtered"] for j, n in alone.items()
        }, rule
        assert scored["4"]["descent"] > 0  # the farthest lies where the pull went


def test_a_byzantine_choco_peer_steers_its_public_copy_to_the_attacked_model() -> None:
    """A CHOCO liar sends honest-looking compressed updates whose sum, the copy every
    neighbour holds of it, converges to its attack on its model (scaled ×100 here); a
    neighbour keeping copies holds exactly the liar's own public copy. Dissensus, a model
    per neighbour, is refused for CHOCO with a reason."""
    from gossipdl.averaging import Arrival, Choco, Round, build_averager
    from gossipdl.averaging.attacks import parse_attack

    x, honest = _swarm(12)
    liar = build_averager("choco", "topk:0.5", attack=parse_attack("scaled"))
    friend = Choco("topk:0.5", keep_copies=True)
    cpu = torch.device("cpu")
    for r in range(40):
        rnd = Round(r, {1: 0.5}, 0.5, resync=r == 0)
        friend.outgoing(honest[0], Round(r, {0: 0.5}, 0.5, resync=r == 0))
        payload = liar.outgoing(x, rnd)
        if r == 0:  # both start from their own model: the friend gets the liar's dense copy
            value, dense = liar.public_copy(), True
        else:
            value, dense = payload, False
        got = friend.decode(value, dense, 50, cpu)  # type: ignore[arg-type]
        friend.incoming(honest[0], Round(r, {0: 0.5}, 0.5, resync=r == 0),
                        {0: Arrival(0.5, got, r, dense=dense)}, [])  # fmt: skip
    assert friend.copies is not None
    torch.testing.assert_close(friend.copies[0], liar.x_hat)  # type: ignore[attr-defined]
    error = torch.linalg.vector_norm(friend.copies[0] - 100 * x) / torch.linalg.vector_norm(100 * x)
    assert float(error) < 1e-3
    with pytest.raises(ValueError, match="one public copy of the sender"):
        build_averager("choco", "topk:0.5", attack=parse_attack("dissensus"))


@pytest.mark.parametrize(
    ("algorithm", "defences", "within"),
    [("choco", ("clip", "balance"), 0.03), ("beer", ("balance",), 0.02)],
)
def test_a_byzantine_public_copy_peer_wrecks_plain_gossip_and_a_defence_holds_it_off(
    tmp_path: Path, algorithm: str, defences: tuple[str, ...], within: float
) -> None:
    """Eight simulated CHOCO or BEER top-10% peers on a ring, peer 3 Byzantine, its public
    copies steered to its model (and BEER's tracker) ×100: the plain algorithm's honest
    peers end below 50%; with each defence (CHOCO: clipping and BALANCE; BEER: BALANCE)
    they stay within ``within`` of the attack-free run, and the liar is the neighbour
    their reports single out."""
    from conftest import small_config

    from gossipdl.experiments.simulated import simulate

    def run(name: str, attack: str | None, defence: str) -> dict:
        profiles = {"liar": {"peers": "3", "byzantine": attack}} if attack else {}
        config = small_config(
            tmp_path / name, peers=8, topology="ring", steps=80, defence=defence,
            algorithm=algorithm, codec="topk:0.1", profiles=profiles,
        )  # fmt: skip
        return simulate(config, step_time=0.01)

    clean = _honest_accuracy(run("clean", None, "none"), set())
    assert _honest_accuracy(run("plain", "scaled", "none"), {3}) < 0.5
    for defence in defences:
        summary = run(defence, "scaled", defence)
        assert _honest_accuracy(summary, {3}) >= clean - within, defence
        assert summary["suspect_neighbours"] == [3], defence


def test_beer_with_a_defence_bounds_a_bad_neighbours_model_and_leaves_out_its_tracker() -> None:
    """BEER mixes two sets of public copies, the models' and the trackers', and a liar steers
    its own copy of each: one update of 1e6 to both moves plain BEER's model by over 1e3.
    With each defence the model moves by less than the honest neighbours' pull: the rule
    sets the liar's model aside, and its tracker, which no rule judges, is left out of the
    round with it, its weight left with the peer."""
    from gossipdl.averaging import build_averager
    from gossipdl.averaging.beer import Pair

    x, honest = _swarm(11)
    g = torch.Generator().manual_seed(12)
    copies = {j: Pair(honest[j - 1], 0.1 * torch.randn(50, generator=g)) for j in (1, 2, 3)}
    tiny = 1e-3 * torch.ones(50)
    updates = {1: Pair(tiny, tiny), 2: Pair(tiny, tiny), 3: Pair(1e6 * x, 1e6 * torch.ones(50))}
    plain = build_averager("beer", "topk:0.5", gamma=0.5)
    assert float(torch.linalg.vector_norm(_rounds(plain, x, copies, updates) - x)) > 1e3
    honest_pull = float(torch.linalg.vector_norm(honest[:3] - x, dim=1).max())
    for defence in ("clip", "trimmed", "median", "balance"):
        averager = build_averager("beer", "topk:0.5", gamma=0.5, defence=defence)
        out = _rounds(averager, x, copies, updates)
        assert float(torch.linalg.vector_norm(out - x)) < honest_pull, defence
        judged = averager.metrics()["neighbours"]  # the model's judge
        assert judged["3"]["filtered"] > max(judged[j]["filtered"] for j in "12"), defence
        assert judged["3"]["distance"] > 1e4 * judged["1"]["distance"], defence


def test_a_byzantine_beer_peer_steers_its_public_copies_to_the_attacked_model_and_tracker() -> None:
    """A BEER liar's compressed updates add up, in every neighbour's copies of it, to its
    attack on its next model and on its tracker (scaled ×100 here); a neighbour keeping
    copies holds exactly the liar's own public copies. Dissensus is refused for BEER."""
    from gossipdl.averaging import Arrival, Beer, Round, build_averager
    from gossipdl.averaging.attacks import parse_attack

    start, honest = _swarm(12)
    x = start + 0.5
    liar = build_averager("beer", "topk:0.5", attack=parse_attack("scaled"))
    friend = Beer("topk:0.5", keep_copies=True)
    for peer in (liar, friend):
        peer.begin(start)
    cpu = torch.device("cpu")
    for r in range(40):
        resync = r == 0
        rnd = Round(r, {1: 0.5}, 0.5, resync=resync, lr=0.1)
        friend.outgoing(honest[0], Round(r, {0: 0.5}, 0.5, resync=resync, lr=0.1))
        payload = liar.outgoing(x, rnd)  # its own model stays x: it tracks (x − start)/lr
        value = liar.vouch() if resync else payload
        got = friend.decode(value, resync, 50, cpu)  # type: ignore[arg-type]
        friend.incoming(honest[0], Round(r, {0: 0.5}, 0.5, resync=resync, lr=0.1),
                        {0: Arrival(0.5, got, r, dense=resync)}, [])  # fmt: skip
    assert friend.models is not None and friend.trackers is not None
    h, g = liar.h, liar.g  # type: ignore[attr-defined]
    torch.testing.assert_close(friend.models.copies[0], h)
    torch.testing.assert_close(friend.trackers.copies[0], g)
    for copy, attacked in ((h, 100 * x), (g, 100 * (x - start) / 0.1)):
        error = torch.linalg.vector_norm(copy - attacked) / torch.linalg.vector_norm(attacked)
        assert float(error) < 1e-3
    with pytest.raises(ValueError, match="one public copy of the sender"):
        build_averager("beer", "topk:0.5", attack=parse_attack("dissensus"))


def test_defended_choco_sets_aside_a_neighbour_whose_copy_stopped_moving() -> None:
    """A frozen CHOCO neighbour's updates shrink to nothing once its copy has caught up: a
    round in which its update moved its copy by nothing is a stale round, and every
    defence leaves it out as it leaves out a replayed model in dense gossip (its weight
    shared among the fresh ones). Honest updates of any size pass."""
    from gossipdl.averaging import build_averager

    x, honest = _swarm(13)
    copies = {1: honest[0], 2: honest[1], 3: honest[2]}  # near: no distance test sees it
    moving = {1: 1e-3 * torch.ones(50), 2: -1e-6 * torch.ones(50)}
    for defence in ("clip", "balance"):
        averager = build_averager("choco", "topk:0.5", gamma=0.5, defence=defence)
        _rounds(averager, x, copies, moving | {3: torch.zeros(50)})
        judged = averager.metrics()["neighbours"]
        assert judged["3"]["filtered"] >= 0.5 and judged["3"]["rounds"] == 2, (defence, judged)
        assert judged["2"]["filtered"] < 0.5, defence  # a small honest update is no stale one
        alive = build_averager("choco", "topk:0.5", gamma=0.5, defence=defence)
        _rounds(alive, x, copies, moving | {3: 1e-3 * torch.ones(50)})
        assert alive.metrics()["neighbours"]["3"]["filtered"] < 0.5, defence


def test_two_scaled_choco_liars_make_no_honest_neighbour_stale() -> None:
    """The stale test measures a neighbour's move against the peer's own, which no liar
    can inflate: two of four neighbours whose updates are 100 times an honest one's (a
    scaled model) leave the honest two fresh, and BALANCE mixes with them alone. Against
    the median sender's move the honest two looked stale, the two liars agreed, and the
    peer took their model (a 4-regular graph of 16: that peer ended at chance)."""
    from gossipdl.averaging import Arrival, Round, build_averager

    x, honest = _swarm(7)
    averager = build_averager("choco", "topk:0.5", gamma=0.5, defence="balance")
    weights = {j: 0.2 for j in (1, 2, 3, 4)}
    resync = Round(0, weights, 0.2, resync=True)
    averager.outgoing(x, resync)
    copies = {1: honest[0], 2: honest[1], 3: honest[2], 4: honest[3]}
    averager.incoming(x, resync, {j: Arrival(0.2, v, 0, dense=True) for j, v in copies.items()}, [])
    g = torch.Generator().manual_seed(1)
    stepped = x + 0.01 * torch.randn(50, generator=g)  # the peer's own local step
    rnd = Round(1, weights, 0.2)
    averager.outgoing(stepped, rnd)
    updates = {j: 0.01 * torch.randn(50, generator=g) for j in (1, 2)}
    updates |= {j: 100 * x - copies[j] for j in (3, 4)}  # both copies jump to 100·x
    out = averager.incoming(stepped, rnd, {j: Arrival(0.2, q, 1) for j, q in updates.items()}, [])
    judged = averager.metrics()["neighbours"]
    assert judged["1"]["filtered"] == judged["2"]["filtered"] == 0.0, judged
    assert judged["3"]["filtered"] == judged["4"]["filtered"] == 0.5, judged  # round 1 of 2
    assert float((out - stepped).norm()) < float((honest - x).norm(dim=1).max())


def test_balance_goes_by_the_median_only_when_no_neighbour_was_set_aside() -> None:
    """With two honest neighbours set aside as stale (their models replayed), two far liars
    that agree are all BALANCE sees: their median would accept them, so only γ‖x‖ counts
    then, and the peer keeps its own model (it once took theirs, and ended at chance)."""
    from gossipdl.averaging import Arrival, Round, build_averager

    x, honest = _swarm(3)
    averager = build_averager("dense", defence="balance")
    liars = (50 * x, 50 * x + 1e-3)
    weights = {j: 0.2 for j in (1, 2, 3, 4)}
    for t in (0, 1):
        models = {1: honest[0], 2: honest[1], 3: liars[0] + t, 4: liars[1] + t}
        arrived = {j: Arrival(0.2, m, t) for j, m in models.items()}
        out = averager.incoming(x, Round(t, weights, 0.2), arrived, [])
    torch.testing.assert_close(out, x)
    judged = averager.metrics()["neighbours"]
    assert judged["1"]["filtered"] == judged["2"]["filtered"] == 0.5  # stale in round 1
