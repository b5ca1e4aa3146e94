"""The batched simulator: stacked peers train and gossip as the per-peer engine's do."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import small_config
from test_workloads import leaf
from typer.testing import CliRunner

from gossipdl import cli
from gossipdl.averaging import Arrival, Round, build_averager
from gossipdl.compression import build_codec
from gossipdl.config import ConfigError, load_config
from gossipdl.experiments.simulated import simulate
from gossipdl.models import build_model
from gossipdl.rundir import RunDir
from gossipdl.sim import stacked as stacked_module
from gossipdl.sim.batched import StackedGossip, check_batchable
from gossipdl.sim.engine import SimulationError
from gossipdl.sim.stacked import StackedModels, StackedSGD
from gossipdl.sim.stacked_layers import _ConvReLU
from gossipdl.topologies import build_topology
from gossipdl.transport.wire import encode, message_size


@pytest.mark.parametrize(
    ("length", "k", "stride", "pad"),
    [
        (40, 5, 2, 2),
        (21, 3, 2, 1),
        (7, 3, 1, 0),
        (3, 5, 2, 2),
        (10, 4, 3, 1),
        (5, 3, 1, 2),
        (2, 5, 3, 2),
    ],  # the last: tap 0 reads only padding
)
def test_the_stacked_convolution_equals_conv1d_and_its_gradients(
    length: int, k: int, stride: int, pad: int
) -> None:
    """Filled and folded tap by tap, any kernel, stride and padding (taps that read only
    padding at a short signal's ends too) gives each peer ``relu(conv1d)`` and autograd's
    gradients of it."""
    torch.manual_seed(0)
    peers, batch, c, c_out = 2, 3, 2, 4
    x = torch.randn(peers, batch, length, c, requires_grad=True)
    w = torch.randn(peers, c_out, c, k, requires_grad=True)
    b = torch.randn(peers, c_out, requires_grad=True)
    out = _ConvReLU.apply(x, w, b, stride, pad)
    weights = torch.randn_like(out)
    found = torch.autograd.grad((out * weights).sum(), (x, w, b))
    for i in range(peers):
        xi, wi, bi = (t.detach()[i].requires_grad_(True) for t in (x, w, b))
        expected = F.relu(F.conv1d(xi.transpose(1, 2), wi, bi, stride, pad)).transpose(1, 2)
        torch.testing.assert_close(out[i], expected)
        grads = torch.autograd.grad((expected * weights[i]).sum(), (xi, wi, bi))
        for got, want in zip(found, grads, strict=True):
            torch.testing.assert_close(got[i], want)


@pytest.mark.parametrize(
    ("name", "shape", "hidden"),
    [
        ("logistic", (40,), None),
        ("mlp", (40,), [16]),
        ("cnn1d", (40,), [8, 8]),  # the hand-written convolution, one channel
        ("cnn1d", (3, 21), [4]),  # ... several channels, an odd length
        ("cnn2d", (6, 6), [4]),  # vmap's path
    ],
)
def test_a_stacked_step_equals_the_per_peer_loop(
    name: str, shape: tuple[int, ...], hidden: list[int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps of five stacked copies in chunks of two (SGD with momentum and weight
    decay, each on its own batch) give every copy the parameters, loss and test accuracy
    (in chunks of 128 samples) torch.optim.SGD gives it alone."""
    monkeypatch.setattr(stacked_module, "EVAL_SAMPLES", 256)
    torch.manual_seed(0)
    template = build_model(name, shape, 10, hidden)
    count, batch = 5, 8
    stacked, sgd = StackedModels(template, count), StackedSGD(0.9, 1e-3)
    stacked.chunk = 2
    models = [copy.deepcopy(template) for _ in range(count)]
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3) for m in models
    ]
    for _ in range(3):
        x, y = torch.randn(count, batch, *shape), torch.randint(0, 10, (count, batch))
        losses, grads = stacked.gradients(x, y)
        sgd.step(stacked.flat, grads, 0.05)
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[i]), y[i])
            loss.backward()
            optimizer.step()
            assert float(losses[i]) == pytest.approx(loss.item(), abs=1e-6)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            torch.testing.assert_close(stacked.flat[i], flat, atol=1e-6, rtol=1e-5)
    x_test, y_test = torch.randn(300, *shape), torch.randint(0, 10, (300,))
    accuracy, loss, none = stacked.evaluate(x_test, y_test)
    assert none is None  # no own samples asked for
    for i, model in enumerate(models):
        with torch.no_grad():
            logits = model(x_test)
        assert float(accuracy[i]) == (logits.argmax(1) == y_test).float().mean().item()
        assert float(loss[i]) == pytest.approx(F.cross_entropy(logits, y_test).item(), abs=1e-5)
    own = stacked.model(2)
    torch.testing.assert_close(
        torch.cat([p.detach().reshape(-1) for p in own.parameters()]), stacked.flat[2]
    )


def test_stacked_models_refuse_what_they_cannot_stack(tmp_path: Path) -> None:
    """Running statistics, a recurrent layer or dropout (vmap has no batching rule for the
    one and refuses the other's draws): a batched run of such a model is refused before its
    run directory is made (it crashed at the first forward pass)."""
    with pytest.raises(ValueError, match="running statistics"):
        StackedModels(torch.nn.BatchNorm1d(4), 2)
    with pytest.raises(ValueError, match="at least one"):
        StackedModels(torch.nn.Linear(2, 2), 0)
    dropout = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with pytest.raises(ValueError, match="dropout"):
        StackedModels(dropout, 2)
    with pytest.raises(ValueError, match=r"recurrent layer \(LSTM\)"):
        StackedModels(torch.nn.LSTM(2, 2), 2)
    config = small_config(tmp_path, dataset="shakespeare", data_dir=str(tmp_path / "data"),
                          model="leaf-lstm", partition="natural", batched=True)  # fmt: skip
    leaf(tmp_path / "data", "shakespeare")
    with pytest.raises(SimulationError, match=r"model 'leaf-lstm' \(it has a recurrent layer"):
        simulate(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "spec",
    [
        "topk:0.1",
        "topk:0.1+qsgd:4+raw",
        "topk:0.05+sign",
        "threshold:0.15",
        "threshold:auto:0.1+delta-varint",
        "sign",
        "sign:64",
        "qsgd:16:128",
    ],
)
def test_batched_choco_rounds_equal_the_per_peer_averagers_and_their_messages(
    tmp_path: Path, spec: str
) -> None:
    """Six CHOCO rounds of each batched codec on a ring of 5, the stacked form against five
    Choco averagers (each codec with its peer's own draws, as the per-peer engine's are)
    fed the same models: the same models after every round (up to float reordering; each
    peer's QSGD rounding and threshold sample drawn as its own averager draws them), and
    every message's layout and size what the real codec and wire encoder make of the same
    difference."""
    count, numel, rounds = 5, 300, 6
    config = small_config(tmp_path, peers=count, algorithm="choco", codec=spec, seed=3)
    mixing = build_topology("ring", count).mixing_matrix()
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    gossip = StackedGossip(config, mixing, start)
    codec = build_codec(spec)
    peers = [build_averager("choco", spec, 3, peer=i) for i in range(count)]
    for p in peers:
        p.begin(start)
    xs = [start.clone() for _ in range(count)]
    stacked = torch.stack(xs)
    for t in range(rounds):
        pulls = torch.randn(count, numel, generator=torch.Generator().manual_seed(10 + t))
        xs = [x + 0.1 * pull for x, pull in zip(xs, pulls, strict=True)]
        stacked += 0.1 * pulls
        rnds = [
            Round(t, {j: float(mixing[i, j]) for j in range(count) if j != i and mixing[i, j]},
                  float(mixing[i, i]), resync=t == 0)
            for i in range(count)
        ]  # fmt: skip
        payloads = [p.outgoing(x, r) for p, x, r in zip(peers, xs, rnds, strict=True)]
        outs = [p.vouch() if t == 0 else q for p, q in zip(peers, payloads, strict=True)]
        # the real codec on the stacked peers' own differences (their models differ from
        # the per-peer ones by float reordering, so their messages may differ in a last bit)
        real = outs if t == 0 else [codec.encode(d)[0] for d in stacked - gossip.x_hat]
        sent = gossip.round(stacked, t)
        for i, message in enumerate(real):
            assert sent.layouts[i] == message.layout(), (t, i)
            frames = encode(sent.kind, i, t + 1, t, message.arrays, message.meta)
            size = message_size(sent.kind, i, t + 1, t, sent.layouts[i].arrays, message.meta)
            assert size == (sum(len(f) for f in frames), len(frames[0])), (t, i)
        cpu = torch.device("cpu")
        xs = [
            p.incoming(x, r, {j: Arrival(w, p.decode(outs[j], t == 0, numel, cpu), t, t == 0)
                              for j, w in r.weights.items()}, [])
            for p, x, r in zip(peers, xs, rnds, strict=True)
        ]  # fmt: skip
        torch.testing.assert_close(stacked, torch.stack(xs), atol=1e-6, rtol=1e-5)
    assert float((stacked - start).abs().max()) > 0.1  # the models moved


def test_sixteen_batched_peers_train_as_the_per_peer_engine_does(tmp_path: Path) -> None:
    """The same 16-peer job (MLP on MNIST-1D, exponential graph, CHOCO top-1%) on both
    simulators: the same model messages, accuracy within half a point, and total bytes
    within 0.5% (the per-peer run also counts its goodbyes, which batched does not), and
    metrics lines with the per-peer engine's keys (the batched one lists its core's)."""
    results = {}
    for batched in (False, True):
        config = load_config(
            None,
            peers=16,
            steps=120,
            model="mlp",
            hidden=[32],
            dataset="mnist1d",
            topology="exponential",
            algorithm="choco",
            codec="topk:0.01",
            eval_every=60,
            batched=batched,
            threads=1,
            out=str(tmp_path / str(batched)),
        )
        results[batched] = simulate(config, step_time=0.01)
    per_peer, stacked = results[False], results[True]
    assert stacked["engine"] == "batched" and per_peer["engine"] == "sim"
    assert stacked["total_messages_sent"] == per_peer["total_messages_sent"] == 16 * 7 * 120
    assert stacked["mean_accuracy"] == pytest.approx(per_peer["mean_accuracy"], abs=0.005)
    assert stacked["mean_accuracy"] > 0.2  # it learnt
    assert stacked["total_bytes_sent"] == pytest.approx(per_peer["total_bytes_sent"], rel=0.005)
    assert stacked["peers_finished"] == 16
    lines = (tmp_path / "True" / "peers" / "3.jsonl").read_text().splitlines()
    assert '"final":true' in lines[-1] and '"accuracy"' in lines[0]
    records = {b: list(RunDir(tmp_path / str(b)).records(3)) for b in (False, True)}
    assert len(records[True]) == len(records[False])
    for ours, theirs in zip(records[True], records[False], strict=True):
        assert set(ours) - {"compute_device"} == set(theirs), set(theirs) ^ set(ours)


@pytest.mark.parametrize(
    "links",
    [
        {"link": "down=1mbit"},  # two arrivals at once: the downlink reads one, then the other
        {"profiles": {"a": {"peers": "0", "step_time": "1ms", "up": "1mbit"},
                      "b": {"peers": "1-3", "step_time": "1ms"}}},  # busy into the next round
    ],
)  # fmt: skip
def test_batched_links_carry_one_message_at_a_time_as_the_per_peer_engines_do(
    tmp_path: Path, links: dict[str, Any]
) -> None:
    """A slow link queues: a sender's copies one after another, behind its last round's, and
    a receiver's arrivals one after another. Batched timed each copy on its own (its time
    and idle_s off by up to 1.9x, either way)."""
    finals = {}
    for batched in (False, True):
        config = small_config(tmp_path / str(batched), peers=4, steps=10, topology="ring",
                              algorithm="dense", batched=batched, **links)  # fmt: skip
        simulate(config, step_time=0.01)
        finals[batched] = [list(RunDir(config.out).records(i))[-1] for i in range(4)]
    for ours, theirs in zip(finals[True], finals[False], strict=True):
        assert ours["time"] == pytest.approx(theirs["time"], abs=1e-4)  # both keep 4 decimals
        assert ours["idle_s"] == pytest.approx(theirs["idle_s"], abs=1e-4)


def test_a_heterogeneous_batched_swarm_keeps_each_peers_clock(tmp_path: Path) -> None:
    """Fast and slow devices (their own step times, latencies and bandwidths) on a ring:
    the batched peers step together, yet each peer's clock, its time waiting for its
    neighbours and the accuracy are the per-peer engine's; a wait past round_timeout,
    which the per-peer engine would count as a miss, stops the batched run, saying so."""
    profiles = {
        "fast": {"peers": "0-5", "step_time": "10ms", "latency": "5ms", "up": "20mbit"},
        "slow": {"peers": "6-7", "step_time": "40ms", "latency": "20ms", "down": "5mbit"},
    }
    records, summaries = {}, {}
    for batched in (False, True):
        config = small_config(
            tmp_path / str(batched),
            peers=8,
            steps=40,
            model="mlp",
            hidden=[16],
            topology="ring",
            algorithm="choco",
            codec="topk:0.05",
            eval_every=20,
            batched=batched,
            profiles=profiles,
        )
        summaries[batched] = simulate(config)
        run = RunDir(config.out)
        records[batched] = [list(run.records(i))[-1] for i in range(8)]
    per_peer, stacked = records[False], records[True]
    for ours, theirs in zip(stacked, per_peer, strict=True):
        # within 0.1%: a message's bytes (its coded indices) may differ by float reordering
        assert ours["time"] == pytest.approx(theirs["time"], rel=1e-3)
        assert ours["idle_s"] == pytest.approx(theirs["idle_s"], abs=3e-3)
    assert min(r["idle_s"] for r in stacked[:6]) > 2 * max(r["idle_s"] for r in stacked[6:])
    simulated = [summaries[b]["simulated_time_s"] for b in (False, True)]
    assert simulated[1] == pytest.approx(simulated[0], rel=1e-3)
    assert summaries[True]["mean_accuracy"] == pytest.approx(
        summaries[False]["mean_accuracy"], abs=0.005
    )
    profiles["slow"]["step_time"] = "3s"  # the fast peers wait 3 s for each round
    config = small_config(
        tmp_path / "late", peers=8, steps=4, batched=True, profiles=profiles, round_timeout=2.5
    )
    with pytest.raises(SimulationError, match=r"peer \d would wait .* round_timeout = 2.5"):
        simulate(config)


@pytest.mark.parametrize(
    ("attack", "defence", "algorithm"),
    [
        ("alie", "clip", "dense"),
        ("dissensus", "trimmed", "dense"),
        ("label-flip", "balance", "dense"),
        ("label-flip", "balance:0.5:3+descent", "dense"),
        ("scaled", "clip", "choco"),
        ("stale", "balance", "choco"),
    ],
)
def test_batched_liars_and_defences_are_the_per_peer_engines(
    tmp_path: Path, attack: str, defence: str, algorithm: str
) -> None:
    """A Byzantine peer and a defence on both simulators: every peer's final accuracy and
    the defence's per-neighbour statistics (with ``+descent`` its running scores too) are
    the per-peer engine's, with CHOCO (its first round a vouch, its defence over the
    public copies) as with dense gossip; a dissenting liar's neighbours see it set aside
    more than the others, and so do a scaled CHOCO liar's."""
    finals = {}
    for batched in (False, True):
        config = small_config(
            tmp_path / str(batched), peers=8, steps=40, model="mlp", hidden=[16],
            dataset="mnist1d", topology="exponential", algorithm=algorithm, codec=(
                "topk:0.1" if algorithm == "choco" else "none"), defence=defence,
            profiles={"liar": {"peers": "3", "byzantine": attack}}, eval_every=0,
            batched=batched,
        )  # fmt: skip
        simulate(config, step_time=0.01)
        run = RunDir(config.out)
        finals[batched] = [list(run.records(i))[-1] for i in range(8)]
    for ours, theirs in zip(finals[True], finals[False], strict=True):
        assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)
        assert ours["neighbours"].keys() == theirs["neighbours"].keys()
        for j, seen in ours["neighbours"].items():
            assert seen == pytest.approx(theirs["neighbours"][j], abs=1e-5)
    if attack in ("dissensus", "scaled"):  # ALIE hides in the spread; a label flipper and
        seen = finals[True][2]["neighbours"]  # a stale one look honest a while
        assert seen["3"]["filtered"] > max(v["filtered"] for j, v in seen.items() if j != "3")


def test_a_batched_run_keeps_the_network_ledgers_keys_and_its_message_limit(
    tmp_path: Path,
) -> None:
    """summary.json's network has the per-peer engine's keys (batched had "delivered" alone),
    and a message over max_message_mb, which neighbours refuse per peer, stops the run
    saying so (it was mixed in)."""
    config = small_config(tmp_path / "a", peers=4, steps=4, batched=True, algorithm="dense")
    network = simulate(config)["network"]
    assert network.keys() >= {"sent", "delivered", "duplicated"}
    assert network["sent"] == network["delivered"] > 0 and network["duplicated"] == 0
    small = small_config(tmp_path / "b", peers=4, steps=4, batched=True, algorithm="dense",
                         max_message_mb=0.001)  # fmt: skip
    with pytest.raises(SimulationError, match=r"over max_message_mb = 0.001: .* \(oversize\)"):
        simulate(small)


def test_a_batched_swarm_that_diverges_stops_and_says_why(tmp_path: Path) -> None:
    """A scaled model with no defence blows the swarm up; per peer, its neighbours drop the
    non-finite messages, which batched does not model: it stops, naming the peer."""
    config = small_config(tmp_path, peers=8, steps=60, model="mlp", hidden=[32],
                          dataset="mnist1d", topology="exponential", batched=True, lr=0.05,
                          profiles={"liar": {"peers": "3", "byzantine": "scaled"}})  # fmt: skip
    with pytest.raises(SimulationError, match=r"peer \d's message of round \d+ holds NaN or Inf"):
        simulate(config, step_time=0.01)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"algorithm": "beer"}, "algorithm 'beer'"),
        ({"algorithm": "choco", "codec": "topk:0.01+fp16"}, "codec 'topk:0.01+fp16'"),
        ({"algorithm": "choco", "codec": "threshold:0.1+qsgd:4"}, "codec 'threshold:0.1+qsgd:4'"),
        ({"algorithm": "choco", "codec": "ternary"}, "codec 'ternary'"),
        ({"algorithm": "choco", "codec": "topk:0.01+qsgd:16:trits"}, "trits coding"),
        ({"algorithm": "choco", "codec": "qsgd:16:trits"}, "trits coding"),
        ({"trigger": "dynamic:0.1"}, "trigger 'dynamic:0.1'"),
        ({"optimizer": "adam"}, "optimizer 'adam'"),
        ({"profiles": {"p": {"peers": "0-1", "latency": "9ms", "jitter": "5ms"}}}, "jitter"),
        ({"topology": "one-peer-exponential"}, "static"),
        ({"overlap": True}, "overlap"),
    ],
)
def test_the_batched_simulator_names_what_it_cannot_run(
    tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    config = small_config(tmp_path, peers=4, batched=True, **changes)
    with pytest.raises(SimulationError, match="batched = false") as info:
        check_batchable(config)
    assert named in str(info.value)


def test_batched_is_a_simulator_setting_and_a_bool(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli.app, ["run", "--batched", "--out", str(tmp_path / "x")], env={"COLUMNS": "80"}
    )
    stderr = " ".join(result.stderr.split())
    assert result.exit_code == 2, stderr
    assert "gossipdl simulate" in stderr and not (tmp_path / "x" / "peers").exists()
    with pytest.raises(ConfigError, match="true or false"):
        load_config(None, batched="yes")
    assert load_config(None, batched="true").batched is True


def test_batched_peers_draw_the_per_peer_engines_batches() -> None:
    """Peer i's index stream is the per-peer engine's sampler's, so the batches agree."""
    from gossipdl.data import IndexStream, load_dataset
    from gossipdl.training import peer_sampler, sampler_seed

    config = load_config(None, peers=4, dataset="mnist1d", batch_size=16)
    dataset = load_dataset("mnist1d")
    sampler = peer_sampler(config, dataset, 2)
    stream = IndexStream(len(sampler), 16, sampler_seed(config, 2))
    for _ in range(40):  # several epochs of a 1000-sample shard
        assert np.array_equal(sampler.next_indices().numpy(), stream.next().numpy())
