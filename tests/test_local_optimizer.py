"""gossipdl's own SGD: torch.optim.SGD's steps and state, without torch._dynamo's import."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from gossipdl.averaging.local_optimizer import SGD


def trained_pair(momentum: float, weight_decay: float, steps: int = 5) -> tuple[list, list]:
    """The same model stepped by ``torch.optim.SGD`` and by ours on the same batches; one
    step leaves a parameter without a gradient (both skip it)."""
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    second = copy.deepcopy(first)
    theirs = torch.optim.SGD(first.parameters(), lr=0.05, momentum=momentum,
                             weight_decay=weight_decay)  # fmt: skip
    ours = SGD(second.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    for step in range(steps):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        for model, optimizer in ((first, theirs), (second, ours)):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step == 2:
                model[2].bias.grad = None
            optimizer.step()
    return [first, theirs], [second, ours]


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 5e-4)])
def test_sgd_steps_as_torch_sgd_bit_for_bit(momentum: float, weight_decay: float) -> None:
    (first, theirs), (second, ours) = trained_pair(momentum, weight_decay)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        if momentum:
            assert torch.equal(theirs.state[a]["momentum_buffer"], ours.state[b]["momentum_buffer"])
        else:
            assert b not in ours.state


def test_sgd_state_loads_into_torch_sgd_and_back() -> None:
    """A checkpoint written with either optimizer resumes in the other, momentum included."""
    (first, theirs), (second, ours) = trained_pair(0.9, 1e-4)
    ours_from_theirs = SGD(first.parameters(), lr=1.0)
    ours_from_theirs.load_state_dict(theirs.state_dict())
    theirs_from_ours = torch.optim.SGD(second.parameters(), lr=1.0)
    theirs_from_ours.load_state_dict(ours.state_dict())
    assert ours.state_dict()["param_groups"] == theirs.state_dict()["param_groups"]
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for model, optimizer in ((first, ours_from_theirs), (second, theirs_from_ours)):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sgd_refuses_what_it_cannot_take() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([], lr=0.1)
    other = SGD([p, torch.nn.Parameter(torch.zeros(1))], lr=0.1).state_dict()
    with pytest.raises(ValueError, match="of 2 parameters, this optimizer has 1"):
        SGD([p], lr=0.1).load_state_dict(other)
    with pytest.raises(ValueError, match="one parameter group"):
        SGD([p], lr=0.1).load_state_dict({"state": {}, "param_groups": []})
    # torch's options gossipdl's SGD does not step with: loaded, they were dropped silently
    for option in ({"nesterov": True, "momentum": 0.9}, {"dampening": 0.1}, {"maximize": True}):
        saved = torch.optim.SGD([p], lr=0.1, **option).state_dict()  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"has {next(iter(option))} = "):
            SGD([p], lr=0.1).load_state_dict(saved)


def test_a_peer_never_imports_torch_dynamo() -> None:
    """torch.optim's step imports torch._dynamo (1.1-1.6 s of a process's start); a peer's
    modules, its model, the default optimizer and a step do not, so neither does the fork
    server (test_forking) and the 8-peer start-up does not wait for it."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        import gossipdl.peers.runner
        from gossipdl.config import load_config
        from gossipdl.data import load_dataset
        from gossipdl.training import initial_model, make_optimizer
        config = load_config(None)
        data = load_dataset(config.dataset)
        model = initial_model(config, data)
        optimizer = make_optimizer(config, model)
        x = torch.randn(4, *data.input_shape)
        torch.nn.functional.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
        optimizer.step()
        print(type(optimizer).__name__, "torch._dynamo" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.split() == ["SGD", "False"], done.stdout + done.stderr
