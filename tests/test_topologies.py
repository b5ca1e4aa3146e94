"""Tests for gossipdl.topologies: graph families, mixing weights, spectral gap, specs, errors."""

from __future__ import annotations

import math
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipdl.topologies import (
    TOPOLOGY_NAMES,
    OnePeerExponential,
    StaticTopology,
    Topology,
    TopologyError,
    available_topologies,
    build_topology,
    connected_components,
    format_topology,
    is_connected,
    is_doubly_stochastic,
    metropolis_hastings,
    register_topology,
    spectral_gap,
)
from gossipdl.topologies import registry as registry_module
from gossipdl.topologies.mixing import check_adjacency

COMPOSITE = [4, 6, 8, 9, 10, 12, 14, 15, 16]


def assert_good_mixing(topo: Topology, round: int = 0) -> None:
    """W is symmetric, nonnegative, doubly stochastic and supported exactly on edges + diagonal."""
    w = topo.mixing_matrix(round)
    adj = topo.adjacency(round)
    assert w.shape == (topo.n, topo.n)
    assert w.dtype == np.float64
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert is_doubly_stochastic(w)
    off_diagonal = w.copy()
    np.fill_diagonal(off_diagonal, 0.0)
    np.testing.assert_array_equal(off_diagonal > 0, adj)
    assert (np.diag(w) > 0).all()


def assert_good_static(topo: Topology) -> None:
    """Adjacency bool, symmetric, loop-free, connected; gap in (0, 1]; neighbours/weights agree."""
    adj = topo.adjacency()
    assert adj.dtype == np.bool_
    np.testing.assert_array_equal(adj, adj.T)
    assert not np.diag(adj).any()
    assert is_connected(adj)
    assert_good_mixing(topo)
    gap = spectral_gap(topo.mixing_matrix())
    assert 0.0 < gap <= 1.0
    w = topo.mixing_matrix()
    for rank in range(topo.n):
        assert topo.neighbors(rank) == np.flatnonzero(adj[rank]).tolist()
        weights = topo.weights(rank)
        assert sorted(weights) == sorted([*topo.neighbors(rank), rank])
        assert weights == pytest.approx({j: w[rank, j] for j in weights})
        assert sum(weights.values()) == pytest.approx(1.0)


def ring_gap(n: int) -> float:
    """Closed form: MH weights on a ring are 1/3, eigenvalues 1/3 + 2/3 cos(2 pi k / n)."""
    return 1.0 - max(abs(1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n)) for k in range(1, n))


# --- static families: neighbour sets by definition -------------------------------------------


@pytest.mark.parametrize("n", range(2, 18))
def test_ring(n: int) -> None:
    topo = build_topology("ring", n)
    assert topo.name == "ring" and topo.n == n and topo.period == 1
    for i in range(n):
        assert topo.neighbors(i) == sorted({(i - 1) % n, (i + 1) % n})
    assert_good_static(topo)
    if n >= 3:
        assert spectral_gap(topo.mixing_matrix()) == pytest.approx(ring_gap(n), abs=1e-12)


def test_ring_concrete_cases() -> None:
    assert build_topology("ring", 5).neighbors(0) == [1, 4]
    two = build_topology("ring", 2)
    assert two.neighbors(0) == [1] and two.neighbors(1) == [0]
    np.testing.assert_allclose(two.mixing_matrix(), [[0.5, 0.5], [0.5, 0.5]])
    eight = build_topology("ring", 8)
    assert eight.weights(0) == pytest.approx({0: 1 / 3, 1: 1 / 3, 7: 1 / 3})
    assert spectral_gap(eight.mixing_matrix()) == pytest.approx(
        1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / 8))
    )
    assert spectral_gap(eight.mixing_matrix()) == pytest.approx(0.19526214587563495)


@pytest.mark.parametrize("n", COMPOSITE)
def test_torus_auto_shape(n: int) -> None:
    topo = build_topology("torus", n)
    rows = max(r for r in range(2, math.isqrt(n) + 1) if n % r == 0)
    cols = n // rows
    assert topo.name == f"torus:{rows}x{cols}"
    for node in range(n):
        r, c = divmod(node, cols)
        expected = {
            ((r - 1) % rows) * cols + c,
            ((r + 1) % rows) * cols + c,
            r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols,
        }
        assert topo.neighbors(node) == sorted(expected)
    assert_good_static(topo)


def test_torus_concrete_cases() -> None:
    assert build_topology("torus", 9).neighbors(4) == [1, 3, 5, 7]
    assert build_topology("torus", 9).name == "torus:3x3"
    assert build_topology("torus", 12).name == "torus:3x4"
    assert build_topology("torus", 16).name == "torus:4x4"
    assert build_topology("torus", 14).name == "torus:2x7"
    explicit = build_topology("torus:2x4", 8)
    assert explicit.name == "torus:2x4"
    assert explicit.neighbors(0) == [1, 3, 4]  # row wrap 0-1-2-3-0, column pair 0-4
    assert build_topology("torus:4X2", 8).neighbors(0) == [1, 2, 6]


@pytest.mark.parametrize(("rows", "cols"), [(3, 3), (4, 4), (3, 5), (5, 4)])
def test_torus_gap_matches_closed_form(rows: int, cols: int) -> None:
    # All degrees are 4, so W = (I + A) / 5 and A's eigenvalues are 2cos(2pi a/R) + 2cos(2pi b/C).
    topo = build_topology(f"torus:{rows}x{cols}", rows * cols)
    eig = [
        (1 + 2 * math.cos(2 * math.pi * a / rows) + 2 * math.cos(2 * math.pi * b / cols)) / 5
        for a in range(rows)
        for b in range(cols)
        if (a, b) != (0, 0)
    ]
    assert spectral_gap(topo.mixing_matrix()) == pytest.approx(1 - max(map(abs, eig)), abs=1e-12)


@pytest.mark.parametrize("n", range(1, 18))
def test_star(n: int) -> None:
    topo = build_topology("star", n)
    assert topo.neighbors(0) == list(range(1, n))
    for leaf in range(1, n):
        assert topo.neighbors(leaf) == [0]
    assert_good_static(topo)


def test_star_weights() -> None:
    w = build_topology("star", 3).mixing_matrix()
    np.testing.assert_allclose(w, [[1 / 3, 1 / 3, 1 / 3], [1 / 3, 2 / 3, 0], [1 / 3, 0, 2 / 3]])


@pytest.mark.parametrize("n", range(1, 18))
def test_complete(n: int) -> None:
    topo = build_topology("complete", n)
    for i in range(n):
        assert topo.neighbors(i) == [j for j in range(n) if j != i]
    assert_good_static(topo)
    np.testing.assert_allclose(topo.mixing_matrix(), np.full((n, n), 1.0 / n))
    assert spectral_gap(topo.mixing_matrix()) == pytest.approx(1.0)


@pytest.mark.parametrize("n", range(1, 18))
def test_exponential(n: int) -> None:
    topo = build_topology("exponential", n)
    hops = [2**k for k in range(n) if 2**k < n]
    for i in range(n):
        expected = {(i + s * h) % n for h in hops for s in (1, -1)} - {i}
        assert topo.neighbors(i) == sorted(expected)
    assert_good_static(topo)


def test_exponential_concrete_cases() -> None:
    assert build_topology("exponential", 8).neighbors(0) == [1, 2, 4, 6, 7]
    assert build_topology("exponential", 5).neighbors(0) == [1, 2, 3, 4]
    assert build_topology("exponential", 12).neighbors(3) == [1, 2, 4, 5, 7, 11]


# --- one-peer exponential (time-varying) -----------------------------------------------------


def test_one_peer_exponential_partners_n8() -> None:
    topo = build_topology("one-peer-exponential", 8)
    assert isinstance(topo, OnePeerExponential)
    assert topo.period == 3 and not topo.is_static
    assert [topo.neighbors(0, t) for t in range(3)] == [[1], [2], [4]]
    assert [topo.partner(0, t) for t in range(6)] == [1, 2, 4, 1, 2, 4]
    assert [topo.partner(5, t) for t in range(3)] == [4, 7, 1]
    np.testing.assert_array_equal(topo.adjacency(4), topo.adjacency(1))
    np.testing.assert_array_equal(topo.mixing_matrix(7), topo.mixing_matrix(1))


@pytest.mark.parametrize(
    ("algorithm", "codec"), [("choco", "topk:0.1"), ("beer", "topk:0.1"), ("powergossip", "none")]
)
def test_algorithms_with_state_per_neighbour_refuse_a_time_varying_graph(
    algorithm: str, codec: str
) -> None:
    """CHOCO's and BEER's sums and PowerGossip's projectors hold per-edge state a graph that
    changes every round breaks (consensus distance 5.3, 346 and 18.4 on 8 peers against
    0.2, 0.09 and 0.4 on the exponential graph); dense gossip has none."""
    from gossipdl import Peer
    from gossipdl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"keeps state per neighbour.*one-peer-exponential"):
        load_config(None, algorithm=algorithm, codec=codec, topology="one-peer-exponential")
    load_config(None, algorithm=algorithm, codec=codec, topology="exponential")
    load_config(None, algorithm="dense", topology="one-peer-exponential")
    with pytest.raises(ValueError, match="use a static topology"):
        Peer(torch.nn.Linear(2, 2), algorithm=algorithm, codec=codec,
             topology="one-peer-exponential")  # fmt: skip


@pytest.mark.parametrize(
    ("n", "period"),
    [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (16, 4), (17, 5), (1000, 10)],
)
def test_one_peer_period_is_ceil_log2(n: int, period: int) -> None:
    assert OnePeerExponential(n).period == period


@pytest.mark.parametrize("n", range(1, 34))
def test_one_peer_rounds_and_union(n: int) -> None:
    topo = OnePeerExponential(n)
    union = np.zeros((n, n), dtype=bool)
    for t in range(topo.period):
        adj = topo.adjacency(t)
        union |= adj
        assert (adj.sum(axis=1) <= 1).all()  # at most one partner per round
        assert_good_mixing(topo, t)
        w = topo.mixing_matrix(t)
        for i in range(n):
            j = i ^ (1 << t)
            if j < n:
                assert topo.neighbors(i, t) == [j]
                assert topo.weights(i, t) == {min(i, j): 0.5, max(i, j): 0.5}
            else:
                assert topo.neighbors(i, t) == []
                assert topo.weights(i, t) == {i: 1.0}
                assert w[i, i] == 1.0
    assert is_connected(union)
    product = topo.period_mixing_matrix()
    assert is_doubly_stochastic(product)
    assert spectral_gap(product) > 0.0


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_one_peer_power_of_two_averages_exactly_in_one_period(n: int) -> None:
    product = OnePeerExponential(n).period_mixing_matrix()
    np.testing.assert_allclose(product, np.full((n, n), 1.0 / n), atol=1e-12)
    assert spectral_gap(product) == pytest.approx(1.0)


def test_one_peer_idle_peer() -> None:
    topo = OnePeerExponential(6)
    assert topo.partner(4, 1) is None and topo.neighbors(4, 1) == []
    assert topo.partner(4, 2) == 0


# --- random graphs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "d"), [(4, 2), (6, 3), (8, 3), (10, 4), (10, 7), (12, 5), (16, 3), (17, 4), (9, 8)]
)
def test_random_regular(n: int, d: int) -> None:
    topo = build_topology(f"random-regular:{d}", n, seed=1)
    assert topo.name == f"random-regular:{d}"
    assert (topo.adjacency().sum(axis=1) == d).all()
    assert_good_static(topo)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 24), d=st.integers(2, 23), seed=st.integers(0, 2**32 - 1))
def test_random_regular_property(n: int, d: int, seed: int) -> None:
    if d >= n or (n * d) % 2:
        with pytest.raises(TopologyError, match=f"random-regular:{d}"):
            build_topology(f"random-regular:{d}", n, seed=seed)
        return
    adj = build_topology(f"random-regular:{d}", n, seed=seed).adjacency()
    assert (adj.sum(axis=1) == d).all()
    assert is_connected(adj)


@pytest.mark.parametrize("seed", range(20))
def test_random_regular_degree_two_redraws_until_one_cycle(seed: int) -> None:
    # Most random 2-regular graphs on 20 nodes are several cycles; only one cycle is accepted.
    adj = build_topology("random-regular:2", 20, seed=seed).adjacency()
    assert (adj.sum(axis=1) == 2).all()
    assert connected_components(adj) == [list(range(20))]


def test_random_regular_reproducible_and_seed_dependent() -> None:
    first = build_topology("random-regular:3", 16, seed=7).adjacency()
    again = build_topology("random-regular:3", 16, seed=7).adjacency()
    np.testing.assert_array_equal(first, again)
    others = [build_topology("random-regular:3", 16, seed=s).adjacency() for s in range(1, 6)]
    assert any(not np.array_equal(first, other) for other in others)


def test_random_regular_full_degree_is_complete() -> None:
    adj = build_topology("random-regular:5", 6).adjacency()
    np.testing.assert_array_equal(adj, ~np.eye(6, dtype=bool))


@pytest.mark.parametrize(
    ("spec", "n", "fragment"),
    [
        ("random-regular:3", 5, "n*D even"),
        ("random-regular:8", 8, "D=8"),
        ("random-regular:0", 8, "D=0"),
        ("random-regular:1", 6, "disconnected"),
        ("random-regular:x", 8, "'x'"),
        ("random-regular:2.5", 8, "'2.5'"),
        ("random-regular", 8, "random-regular:D"),
    ],
)
def test_random_regular_errors(spec: str, n: int, fragment: str) -> None:
    with pytest.raises(TopologyError, match=fragment.replace("*", r"\*")):
        build_topology(spec, n)


@pytest.mark.parametrize("n", [8, 12, 17])
def test_erdos_renyi_connected_and_reproducible(n: int) -> None:
    built = []
    for seed in range(30):
        try:
            built.append((seed, build_topology("erdos-renyi:0.5", n, seed=seed)))
        except TopologyError as exc:
            assert "disconnected" in str(exc)
    assert len(built) >= 10
    seed, topo = built[0]
    assert topo.name == "erdos-renyi:0.5"
    assert_good_static(topo)
    np.testing.assert_array_equal(
        topo.adjacency(), build_topology("erdos-renyi:0.5", n, seed=seed).adjacency()
    )
    assert any(not np.array_equal(topo.adjacency(), other.adjacency()) for _, other in built[1:])


def test_erdos_renyi_p1_is_complete() -> None:
    adj = build_topology("erdos-renyi:1", 7, seed=3).adjacency()
    np.testing.assert_array_equal(adj, ~np.eye(7, dtype=bool))


def test_erdos_renyi_disconnected_draw_raises() -> None:
    with pytest.raises(TopologyError, match="disconnected") as info:
        build_topology("erdos-renyi:0.001", 16, seed=0)
    message = str(info.value)
    assert "seed" in message and "larger P" in message and "n=16" in message


@pytest.mark.parametrize("arg", ["0", "1.5", "-0.2", "abc", "nan", ""])
def test_erdos_renyi_bad_probability(arg: str) -> None:
    with pytest.raises(TopologyError, match="erdos-renyi"):
        build_topology(f"erdos-renyi:{arg}", 8)


# --- edges:PATH -------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "graph.txt") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_edges_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        # a 4-cycle plus a chord
        0 1
        1 2   # trailing comment

        2,3
        3 0
        0 2
        2 0
        """,
    )
    topo = build_topology(f"edges:{path}", 4)
    assert topo.name == f"edges:{path}"
    assert [topo.neighbors(i) for i in range(4)] == [[1, 2, 3], [0, 2], [0, 1, 3], [0, 2]]
    assert_good_static(topo)


def test_an_edges_file_breaks_lines_at_newlines_alone_and_takes_a_byte_order_mark(
    tmp_path: Path,
) -> None:
    """``splitlines`` broke at U+2028 and form feeds too: a comment's text after one was
    read as an edge, and the lines after a form feed were numbered one too far; an
    editor's byte-order mark made the first edge unreadable."""
    path = tmp_path / "edges.txt"
    path.write_bytes("\ufeff0 1\r\n# ring \u2028edited by bob\n1 2\n\x0c\n2 0\n".encode())
    topo = build_topology(f"edges:{path}", 3)
    assert [topo.neighbors(i) for i in range(3)] == [[1, 2], [0, 2], [0, 1]]
    path.write_text("0 1\n\x0c\nnot an edge\n")
    with pytest.raises(TopologyError, match=re.escape(f"{path}:3:")):
        build_topology(f"edges:{path}", 2)


def test_a_negative_seed_is_refused_by_name() -> None:
    """numpy's generators take no seed below 0: a traceback from ``topology show``."""
    with pytest.raises(TopologyError, match="seed must be 0 or more, got seed=-1"):
        build_topology("random-regular:3", 8, seed=-1)


def test_edges_file_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(TopologyError, match="not found") as info:
        build_topology(f"edges:{missing}", 4)
    assert "nope.txt" in str(info.value)


@pytest.mark.parametrize(
    ("text", "n", "pattern"),
    [
        ("0 1\n1 2\n0 1 2\n", 3, r"graph\.txt:3: expected one edge"),
        ("0 1\n# c\na b\n", 3, r"graph\.txt:3: expected one edge .* of node ids"),
        ("0 1\n1 3\n", 3, r"graph\.txt:2: node 3 is out of range for n=3"),
        ("0 -1\n", 3, r"graph\.txt:1: expected one edge"),
        # int() took these: 1_0 as node 10, +1, other scripts' digits, and two commas
        ("0 1\n1_0 1\n", 11, r"graph\.txt:2: expected one edge"),
        ("+1 0\n", 2, r"graph\.txt:1: expected one edge"),
        ("0 \u0661\n", 2, r"graph\.txt:1: expected one edge"),
        ("0,,1,\n", 2, r"graph\.txt:1: expected one edge"),
        ("0 1\n1 1\n", 2, r"graph\.txt:2: self loop"),
        ("0 1\n2 3\n", 4, r"disconnected graph \(2 components"),
        ("0 1\n1 2\n2 3\n", 6, "names 4 nodes but n=6; nodes with no edge: 4, 5"),
        ("# nothing\n", 3, "names 0 nodes but n=3"),
    ],
)
def test_edges_file_errors(tmp_path: Path, text: str, n: int, pattern: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TopologyError, match=pattern):
        build_topology(f"edges:{path}", n)


def test_an_edges_file_is_read_to_a_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``edges:/dev/zero`` read until memory ran out (MemoryError, not a TopologyError)."""
    from gossipdl.topologies import edge_file

    monkeypatch.setattr(edge_file, "MAX_EDGE_FILE_BYTES", 1000)
    with pytest.raises(TopologyError, match="is over 0 MiB"):
        build_topology("edges:/dev/zero", 4)
    path = write(tmp_path, "0 1\n" * 300)  # 1,200 bytes
    with pytest.raises(TopologyError, match=r"graph\.txt is over"):
        build_topology(f"edges:{path}", 2)


# --- registry and specs -----------------------------------------------------------------------


def test_available_topologies() -> None:
    expected = {
        "ring",
        "torus",
        "star",
        "complete",
        "exponential",
        "one-peer-exponential",
        "random-regular",
        "erdos-renyi",
        "edges",
    }
    assert set(TOPOLOGY_NAMES) == expected
    assert expected <= set(available_topologies())


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(TopologyError, match="unknown topology 'hypercube'") as info:
        build_topology("hypercube", 8)
    for name in ("ring", "torus", "one-peer-exponential", "random-regular:D", "module.path:"):
        assert name in str(info.value)
    with pytest.raises(TopologyError, match="unknown topology 'random-regulr'"):
        build_topology("random-regulr:3", 8)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 11, 13, 17])
def test_torus_prime_or_small_n_errors(n: int) -> None:
    with pytest.raises(TopologyError, match=f"n={n} ") as info:
        build_topology("torus", n)
    message = str(info.value)
    assert "4, 6, 8, 9" in message and "torus:" in message


def test_torus_prime_error_suggests_nearest() -> None:
    with pytest.raises(TopologyError, match=r"n=7 is prime.*nearest: 6, 8"):
        build_topology("torus", 7)


@pytest.mark.parametrize(
    ("spec", "n", "pattern"),
    [
        ("torus:3x3", 8, r"torus:3x3 has 9 peers but n=8.*torus:2x4"),
        ("torus:1x4", 4, "rows and cols >= 2"),
        ("torus:3by3", 9, "torus:RxC"),
        ("torus:", 9, "torus:RxC"),
        ("ring:3", 5, "takes no argument"),
        ("complete:x", 5, "takes no argument"),
        ("", 5, "non-empty"),
    ],
)
def test_spec_errors(spec: str, n: int, pattern: str) -> None:
    with pytest.raises(TopologyError, match=pattern):
        build_topology(spec, n)


@pytest.mark.parametrize("n", [0, -3])
def test_bad_peer_count(n: int) -> None:
    with pytest.raises(TopologyError, match=f"n={n}"):
        build_topology("complete", n)


@pytest.mark.parametrize(("n", "seed"), [(2.0, 0), (True, 0), (4, "x"), (4, 1.5)])
def test_bad_peer_count_or_seed_type(n: object, seed: object) -> None:
    with pytest.raises(TopologyError, match="must be"):
        build_topology("ring", n, seed=seed)  # type: ignore[arg-type]


def test_ring_needs_two_peers() -> None:
    with pytest.raises(TopologyError, match="n=1"):
        build_topology("ring", 1)


def test_spec_is_case_and_space_insensitive() -> None:
    assert build_topology("  Ring ", 5).neighbors(0) == [1, 4]
    assert build_topology("TORUS : 3x3", 9).neighbors(4) == [1, 3, 5, 7]


def test_topology_error_is_value_error() -> None:
    assert issubclass(TopologyError, ValueError)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test register names without leaking them into other tests."""
    monkeypatch.setattr(registry_module, "_FACTORIES", dict(registry_module._FACTORIES))
    monkeypatch.setattr(registry_module, "_USAGE", dict(registry_module._USAGE))


@pytest.mark.usefixtures("fresh_registry")
def test_register_topology() -> None:
    def path_graph(n: int, arg: str | None, seed: int) -> Topology:
        hops = int(arg) if arg else 1
        return StaticTopology.from_edges(n, [(i, i + hops) for i in range(n - hops)], name="path")

    register_topology("path", path_graph, usage="path[:H]")
    assert "path" in available_topologies()
    assert "path" not in TOPOLOGY_NAMES
    assert build_topology("path", 4).neighbors(1) == [0, 2]
    assert build_topology("path:2", 5).neighbors(2) == [0, 4]
    with pytest.raises(TopologyError, match="already registered"):
        register_topology("path", path_graph)
    with pytest.raises(TopologyError, match="path\\[:H\\]"):
        build_topology("nope", 4)
    register_topology("path", lambda n, arg, seed: build_topology("ring", n), replace=True)
    assert build_topology("path", 4).neighbors(0) == [1, 3]
    with pytest.raises(TopologyError, match="topology name"):
        register_topology("bad:name", path_graph)


@pytest.mark.usefixtures("fresh_registry")
def test_registered_factory_must_return_matching_topology() -> None:
    register_topology("liar", lambda n, arg, seed: build_topology("ring", n + 1))
    with pytest.raises(TopologyError, match="over 5 peers, expected n=4"):
        build_topology("liar", 4)


CUSTOM_MODULE = """
import numpy as np
from gossipdl.topologies import Topology

class Chain(Topology):
    '''Path graph; the seed shifts which end is node 0 (to prove it is passed).'''

    def __init__(self, n, seed=0):
        super().__init__(n, name=f"chain(seed={seed})")

    def adjacency(self, round=0):
        adj = np.zeros((self.n, self.n), dtype=bool)
        for i in range(self.n - 1):
            adj[i, i + 1] = adj[i + 1, i] = True
        return adj

class Directed(Chain):
    def adjacency(self, round=0):
        adj = np.zeros((self.n, self.n), dtype=bool)
        adj[0, 1] = True
        return adj

class NoSeed(Chain):
    def __init__(self, n):
        super().__init__(n)

def not_a_topology(n, seed):
    return [n, seed]

CONSTANT = 3
"""


@pytest.fixture
def custom_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "gossipdl_test_custom_topologies"
    (tmp_path / f"{name}.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def test_custom_class_spec(custom_module: str) -> None:
    topo = build_topology(f"{custom_module}:Chain", 4, seed=9)
    assert type(topo).__name__ == "Chain"
    assert topo.name == "chain(seed=9)"
    assert [topo.neighbors(i) for i in range(4)] == [[1], [0, 2], [1, 3], [2]]
    assert_good_static(topo)


@pytest.mark.parametrize(
    ("attr", "pattern"),
    [
        ("Missing", "has no attribute 'Missing'"),
        ("not_a_topology", "produced list, not a Topology"),
        ("NoSeed", "calling NoSeed"),
        ("CONSTANT", "is not callable"),
    ],
)
def test_custom_class_errors(custom_module: str, attr: str, pattern: str) -> None:
    with pytest.raises(TopologyError, match=pattern):
        build_topology(f"{custom_module}:{attr}", 4)


def test_custom_topology_adjacency_is_validated(custom_module: str) -> None:
    """When it is built, not in the first round that reads it (a traceback there)."""
    with pytest.raises(TopologyError, match="not symmetric"):
        build_topology(f"{custom_module}:Directed", 3)


class _Split(Topology):
    """Two pairs, apart."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n, name="split")

    def adjacency(self, round: int = 0) -> np.ndarray:
        a = np.zeros((self.n, self.n), bool)
        for i in range(0, self.n - 1, 2):
            a[i, i + 1] = a[i + 1, i] = True
        return a


class _CopyPeerZero(Topology):
    """A ring whose weights have every peer copy peer 0: not a neighbour of peer 2."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n, name="copy-zero")

    def adjacency(self, round: int = 0) -> np.ndarray:
        return build_topology("ring", self.n).adjacency()

    def _mixing(self, round: int) -> np.ndarray:
        w = np.zeros((self.n, self.n))
        w[:, 0] = 1.0
        return w


@pytest.mark.parametrize(
    ("name", "says"),
    [("_Split", "not connected"), ("_CopyPeerZero", "not symmetric, doubly stochastic")],
)
def test_a_plugin_topology_is_checked_for_what_averaging_needs_when_it_is_built(
    name: str, says: str
) -> None:
    """A disconnected graph was taken (consensus never comes, and the dynamic trigger failed
    in a round), and so were weights that move the swarm's mean."""
    with pytest.raises(TopologyError, match=says):
        build_topology(f"{__name__}:{name}", 4)


def test_custom_module_missing() -> None:
    with pytest.raises(TopologyError, match=r"cannot import module 'no_such_pkg\.topos'") as info:
        build_topology("no_such_pkg.topos:Graph", 4)
    assert "ring" in str(info.value)


# --- Topology base behaviour ------------------------------------------------------------------


def test_rank_and_round_validation() -> None:
    topo = build_topology("ring", 4)
    with pytest.raises(TopologyError, match="rank 4 is out of range for n=4"):
        topo.neighbors(4)
    with pytest.raises(TopologyError, match="rank -1"):
        topo.weights(-1)
    with pytest.raises(TopologyError, match="round=-1"):
        topo.mixing_matrix(-1)
    assert topo.neighbors(0, round=12345) == [1, 3]


def test_matrices_are_cached_and_read_only() -> None:
    topo = build_topology("torus", 9)
    w = topo.mixing_matrix()
    assert topo.mixing_matrix(5) is w
    with pytest.raises(ValueError):
        w[0, 0] = 0.0
    with pytest.raises(ValueError):
        topo.adjacency()[0, 1] = False


def test_static_topology_from_matrix_and_edges() -> None:
    topo = StaticTopology(np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]]), name="path3")
    assert topo.name == "path3" and topo.n == 3 and topo.period == 1
    assert topo.neighbors(1) == [0, 2]
    assert "path3" in repr(topo)
    same = StaticTopology.from_edges(3, [(0, 1), (2, 1), (1, 0)])
    np.testing.assert_array_equal(same.adjacency(), topo.adjacency())
    with pytest.raises(TopologyError, match=r"outside 0\.\.2"):
        StaticTopology.from_edges(3, [(0, 3)])
    with pytest.raises(TopologyError, match="self loop"):
        StaticTopology.from_edges(3, [(1, 1)])


def test_topology_requires_adjacency() -> None:
    with pytest.raises(TypeError):
        Topology(3)  # type: ignore[abstract]


# --- mixing.py ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matrix", "pattern"),
    [
        (np.zeros((2, 3), dtype=bool), "square"),
        (np.array([[0, 1], [0, 0]]), "not symmetric"),
        (np.array([[1, 0], [0, 0]]), "self loop at node 0"),
        (np.array([[0, 2], [2, 0]]), "0/1"),
    ],
)
def test_check_adjacency_errors(matrix: np.ndarray, pattern: str) -> None:
    with pytest.raises(TopologyError, match=pattern):
        check_adjacency(matrix)
    with pytest.raises(TopologyError, match=pattern):
        metropolis_hastings(matrix)


def test_metropolis_hastings_path() -> None:
    # path 0-1-2-3: degrees 1, 2, 2, 1 -> edge weights 1/3 everywhere.
    adj = np.zeros((4, 4), dtype=bool)
    for i in range(3):
        adj[i, i + 1] = adj[i + 1, i] = True
    w = metropolis_hastings(adj)
    expected = np.array(
        [
            [2 / 3, 1 / 3, 0, 0],
            [1 / 3, 1 / 3, 1 / 3, 0],
            [0, 1 / 3, 1 / 3, 1 / 3],
            [0, 0, 1 / 3, 2 / 3],
        ]
    )
    np.testing.assert_allclose(w, expected)


def test_connectivity_helpers() -> None:
    two_pairs = np.zeros((4, 4), dtype=bool)
    two_pairs[0, 1] = two_pairs[1, 0] = two_pairs[2, 3] = two_pairs[3, 2] = True
    assert not is_connected(two_pairs)
    assert connected_components(two_pairs) == [[0, 1], [2, 3]]
    assert spectral_gap(metropolis_hastings(two_pairs)) == pytest.approx(0.0, abs=1e-12)
    assert is_connected(np.zeros((1, 1), dtype=bool))
    assert not is_connected(np.zeros((2, 2), dtype=bool))


def test_is_doubly_stochastic() -> None:
    assert is_doubly_stochastic(np.full((3, 3), 1 / 3))
    assert not is_doubly_stochastic(np.array([[0.5, 0.5], [1.0, 0.0]]))  # columns 1.5, 0.5
    assert not is_doubly_stochastic(np.array([[1.5, -0.5], [-0.5, 1.5]]))  # negative entries
    assert not is_doubly_stochastic(np.ones((2, 3)) / 3)
    assert is_doubly_stochastic(np.array([[0.5, 0.5], [0.5, 0.5 + 1e-7]]), tol=1e-6)
    assert not is_doubly_stochastic(np.array([[0.5, 0.5], [0.5, 0.5 + 1e-7]]), tol=1e-9)


def test_spectral_gap_values() -> None:
    assert spectral_gap(np.eye(1)) == 1.0
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0)  # no communication, no mixing
    swap = np.array([[0.0, 1.0], [1.0, 0.0]])  # eigenvalue -1: oscillates, never averages
    assert spectral_gap(swap) == pytest.approx(0.0)
    lazy = np.array([[0.75, 0.25], [0.25, 0.75]])  # eigenvalues 1, 0.5
    assert spectral_gap(lazy) == pytest.approx(0.5)
    # Non-symmetric doubly stochastic: 1 - ||W - J||_2.
    cyc = np.roll(np.eye(3), 1, axis=1) * 0.5 + np.eye(3) * 0.5
    assert spectral_gap(cyc) == pytest.approx(1 - np.linalg.norm(cyc - 1 / 3, 2))
    with pytest.raises(TopologyError, match="doubly stochastic"):
        spectral_gap(np.array([[1.0, 0.0], [0.5, 0.5]]))
    with pytest.raises(TopologyError, match="square"):
        spectral_gap(np.ones((2, 3)))


@st.composite
def random_graphs(draw: st.DrawFn) -> np.ndarray:
    n = draw(st.integers(1, 12))
    bits = draw(st.lists(st.booleans(), min_size=n * (n - 1) // 2, max_size=n * (n - 1) // 2))
    adj = np.zeros((n, n), dtype=bool)
    adj[np.triu_indices(n, k=1)] = bits
    return adj | adj.T


@settings(max_examples=150, deadline=None)
@given(adj=random_graphs())
def test_metropolis_hastings_property(adj: np.ndarray) -> None:
    w = metropolis_hastings(adj)
    assert is_doubly_stochastic(w)
    np.testing.assert_array_equal(w, w.T)
    assert (np.diag(w) > 0).all()
    n = adj.shape[0]
    # Independent connectivity check: (I + A)^(n-1) has no zero entry iff connected.
    reach = np.linalg.matrix_power(np.eye(n, dtype=np.int64) + adj, max(n - 1, 1)) > 0
    assert is_connected(adj) == bool(reach.all())
    gap = spectral_gap(w)
    assert 0.0 <= gap <= 1.0
    if is_connected(adj):
        assert gap > 1e-9
    else:
        assert gap < 1e-9


# --- format_topology --------------------------------------------------------------------------


def test_format_static() -> None:
    text = format_topology(build_topology("ring", 5))
    lines = text.splitlines()
    assert lines[0] == "ring: n=5, static"
    assert "  0: 1 4" in lines
    assert "0.333" in text and "spectral gap: 0.4607" in text
    assert text.count("\n  4  ") == 1  # one matrix row per rank


def test_format_time_varying() -> None:
    text = format_topology(build_topology("one-peer-exponential", 8))
    assert text.startswith("one-peer-exponential: n=8, time-varying with period 3")
    assert "round 0:" in text and "round 2:" in text and "round 3:" not in text
    assert "spectral gap of one period (W_2 ... W_0): 1.0000" in text
    long = format_topology(build_topology("one-peer-exponential", 64))
    assert "round 3:" in long and "round 4:" not in long
    assert "2 more rounds" in long
    assert "not shown above 16 peers" in long


def test_format_large_static_omits_matrix() -> None:
    text = format_topology(build_topology("star", 20))
    assert "  0: 1 2 3" in text and "not shown above 16 peers" in text
    assert "spectral gap: 0.0500" in text


@pytest.mark.parametrize(
    ("spec", "n", "rounds"),
    [("ring", 8, 4), ("ring", 5, 2), ("complete", 8, 1), ("torus", 9, 2), ("star", 6, 2),
     ("exponential", 8, 2), ("one-peer-exponential", 8, 3), ("one-peer-exponential", 16, 4)],
)  # fmt: skip
def test_spread_rounds_is_how_long_news_takes_to_reach_everyone(
    spec: str, n: int, rounds: int
) -> None:
    topology = build_topology(spec, n=n)
    assert all(topology.spread_rounds(t) == rounds for t in range(3))


def test_a_member_set_the_topology_cannot_be_built_on_gets_the_fallback_graph() -> None:
    """A swarm that shrank (eviction, deaths) below what its topology allows keeps going:
    random-regular:4 over 3 members and a torus over 13 get the exponential graph, the same
    on every peer; a set the topology allows keeps its own graph."""
    from gossipdl.protocol.rounds import FALLBACK, Topologies

    for spec, ids in (("random-regular:4", [2, 5, 9]), ("torus", list(range(13)))):
        with pytest.raises(TopologyError):
            build_topology(spec, len(ids), 0)
        fallback = build_topology(FALLBACK, len(ids), 0)
        for index, me in enumerate(ids):
            weights, self_weight = Topologies(spec, 0).mixing(ids, me, 0)
            row = fallback.weights(index)
            assert weights == {ids[p]: w for p, w in row.items() if p != index}
            assert self_weight == pytest.approx(row[index])
    kept = Topologies("random-regular:4", 0).mixing(list(range(8)), 0, 0)[0]
    assert len(kept) == 4  # still 4-regular where it can be
