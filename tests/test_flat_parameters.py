"""The parameters as views of one vector (issue 25's flat buffer): what training, a
round and the protocol core may and may not do with it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from conftest import small_config

import gossipdl
from gossipdl.averaging import build_averager
from gossipdl.averaging.triggers import parse_trigger
from gossipdl.models import ModelError, build_model
from gossipdl.models.parameters import FlatParameters, averaged_parameters
from gossipdl.peers.membership import Member, Membership
from gossipdl.protocol.core import GossipCore, Settings
from gossipdl.rundir import RunDir
from gossipdl.sim.engine import Simulation


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _gathered(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def test_a_peer_refuses_a_complex_parameter_by_name_and_takes_every_real_dtype() -> None:
    """A complex parameter failed deep in the first copy with ``torch.cat(): input types
    can't be cast to the desired output type Float``, naming nothing: it is refused up front,
    by name, by a Peer and by a custom model's build. Real dtypes go through the float32
    vector and back, and are taken."""
    model = _mlp()
    model.phase = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    peers = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    with pytest.raises(ValueError, match=r"parameter 'phase' is complex64: .*view_as_real"):
        gossipdl.Peer(model, None, rank=0, peers=peers, startup_timeout=1)
    with pytest.raises(ModelError, match=f"custom model '{__name__}:complex_model': .*'phase'"):
        build_model(f"{__name__}:complex_model", (5,), 3)
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool):
        model = _mlp()
        model.extra = torch.nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=False)
        params = averaged_parameters(model)
        assert params[0] is model.extra  # its own parameters come before its children's
        assert FlatParameters(params).copy()[:2].tolist() == [1.0, 1.0]


def complex_model(input_shape: tuple[int, ...], num_classes: int, hidden: object) -> object:
    model = torch.nn.Linear(input_shape[0], num_classes)
    model.phase = torch.nn.Parameter(torch.ones(num_classes, dtype=torch.complex64))
    return model


def test_the_parameters_become_views_of_one_vector_and_train_as_before() -> None:
    """The same model flattened and not, each with SGD and momentum built before the
    flattening (as a peer is handed them): the same losses and parameters, and the vector
    is the model throughout, a step's writes and a round's included."""
    plain, flat_model = _mlp(), _mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, flat_model)]
    flat = FlatParameters(list(flat_model.parameters()))
    live = flat.live()
    assert live is not None and live.numel() == 5 * 7 + 7 + 7 * 3 + 3
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    for model, opt in zip((plain, flat_model), opts, strict=True):
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(plain.parameters(), flat_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert flat.live() is live  # still views after the optimizer's steps
    gathered = _gathered(list(plain.parameters()))
    assert torch.equal(live, gathered) and torch.equal(flat.copy(), gathered)
    copied = flat.copy()
    copied.add_(1.0)  # a copy is not the model
    assert torch.equal(live, gathered)
    flat.load_(copied)
    assert torch.equal(flat_model[2].bias.detach(), plain[2].bias.detach() + 1.0)


@pytest.mark.parametrize("case", ["mixed dtypes", "shared memory", "rebound later"])
def test_parameters_that_cannot_share_one_vector_are_gathered_as_before(case: str) -> None:
    """No vector where parameters differ in dtype or share memory; and a parameter
    something rebinds later (``model.to``, a user's own ``.data =``) ends the vector's
    use: the parameters are gathered and written one by one, still right."""
    model = _mlp()
    params = list(model.parameters())
    if case == "mixed dtypes":
        model[2].bias.data = model[2].bias.data.double()
    elif case == "shared memory":
        model[2].bias.data = model[0].bias.data[:3]
    flat = FlatParameters(params)
    if case == "rebound later":
        assert flat.live() is not None
        model[0].weight.data = model[0].weight.data.clone()
    assert flat.live() is None
    assert torch.equal(flat.copy(), _gathered(params))
    new = torch.arange(float(flat.numel))
    flat.load_(new)
    if case == "shared memory":  # the last write of a shared value wins, as with set_params
        new[5 * 7 : 5 * 7 + 3] = new[-3:]
    assert torch.equal(_gathered(params), new)


def test_the_core_never_publishes_the_engines_model() -> None:
    """A round that hands the model back unchanged (gossip learning with nobody to walk
    to) publishes a copy: the engine's x may be its live parameters, which training
    writes next, and a joining member must get the round's model, not a torn one."""
    me = Membership([Member(0, "tcp://h:10", 0)])
    core = GossipCore(
        0,
        me,
        averager=build_averager("gossip-learning", "none", 0),
        trigger=parse_trigger("always"),
        settings=Settings(),
        model=torch.zeros(4),
    )
    x = torch.full((4,), 3.0)
    core.open_round(0.0, x)
    progress = core.poll(0.0)
    assert progress.model is not None and torch.equal(progress.model, x)
    _, published = core.published
    assert published.data_ptr() != x.data_ptr()
    x.fill_(-1.0)  # training's next step
    assert torch.equal(published, torch.full((4,), 3.0))


def test_a_checkpoint_of_a_flattened_model_loads_into_one_and_keeps_it_flat() -> None:
    """A state dict saved from the views and loaded into another flattened model (a
    peer resuming from its checkpoint) gives the same parameters, still one vector."""
    saved, resumed = (
        _mlp(),
        torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)),
    )
    FlatParameters(list(saved.parameters()))
    flat = FlatParameters(list(resumed.parameters()))
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    live = flat.live()
    assert live is not None
    assert torch.equal(live, _gathered(list(saved.parameters())))


def test_a_model_flattened_before_keeps_its_vector() -> None:
    """A second FlatParameters on one model (a second Peer built on it) takes the vector
    the parameters already are instead of finding them sharing memory and gathering."""
    model = _mlp()
    first = FlatParameters(list(model.parameters())).live()
    second = FlatParameters(list(model.parameters())).live()
    assert first is not None and second is not None
    assert second.data_ptr() == first.data_ptr() and second.numel() == first.numel()


def test_a_round_starts_from_the_live_vector_unless_it_sends_that_memory() -> None:
    """What both engines hand a synchronous round: the live vector, or a copy of it where
    the round's payload is the model's own memory (dense gossip, uncompressed)."""
    flat = FlatParameters(list(_mlp().parameters()))
    live = flat.live()
    assert live is not None and flat.round_input(lambda v: False) is live
    copied = flat.round_input(lambda v: True)
    assert copied.data_ptr() != live.data_ptr() and torch.equal(copied, live)


@pytest.mark.parametrize(("algorithm", "codec"), [("choco", "topk:0.1"), ("dense", "none")])
def test_simulated_peers_round_on_their_live_vectors_through_a_restart(
    tmp_path: Path, algorithm: str, codec: str
) -> None:
    """The simulator's peers hold their parameters as the real ones do, through a kill
    and a restart (a new model, flattened anew): at the end every peer's parameters are
    still views of one vector, and what its core publishes for a joiner is not that
    vector (training would write it)."""
    config = small_config(
        tmp_path,
        peers=4,
        steps=80,
        algorithm=algorithm,
        codec=codec,
        heartbeat=0.25,
        dead_after=1.0,
        round_timeout=0.5,
        faults=[{"at": "0.5s", "kill": "2"}, {"at": "1.5s", "restart": "2"}],
        profiles={"all": {"peers": "0-3", "step_time": "20ms"}},
    )
    run = RunDir(config.out)
    run.create()
    simulation = Simulation(config, run)
    simulation.run()
    assert not simulation.failures and all(p.steps == 80 for p in simulation.peers)
    for peer in simulation.peers:
        live = peer.flat_params.live()
        assert live is not None, f"peer {peer.id}'s parameters are no longer one vector"
        assert peer.core.published[1].data_ptr() != live.data_ptr()
