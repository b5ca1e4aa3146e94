"""Checkpoints of one peer (model, optimizer, step), written atomically so a peer killed
mid-write still leaves the previous one, and read back without unpickling code."""

from __future__ import annotations

from pathlib import Path

import torch

from gossipdl.averaging.local_optimizer import LocalOptimizer
from gossipdl.training import save_atomic

FORMAT = 1


WITHOUT = "delete it, and the peer rejoins as a newcomer that takes a neighbour's model"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or made for another model."""


def save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: LocalOptimizer,
    step: int,
    *,
    peer: int | None = None,
    swarm: str | None = None,
) -> None:
    """Write the checkpoint of ``step`` to ``path`` (atomically, see :func:`save_atomic`),
    naming the ``peer`` and ``swarm`` it is of, so that it resumes no other."""
    state = {
        "format": FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "peer": peer,
        "swarm": swarm,
    }
    save_atomic(state, path)


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: LocalOptimizer,
    *,
    peer: int | None = None,
    swarm: str | None = None,
) -> int:
    """Restore ``model`` and ``optimizer`` from ``path``; returns the step it was taken at.
    CheckpointError if it names another ``peer`` or ``swarm`` than the ones given (one
    written before it named them passes)."""
    if not path.is_file():
        raise CheckpointError(
            f"no checkpoint at {path}, and no metrics of that peer: it never ran in this run "
            "directory; check --resume and --rank (a peer that ran comes back from its "
            "checkpoint, checkpoint_every > 0, or without one as a newcomer)"
        )
    device = next(model.parameters()).device
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch raises many kinds for a torn or foreign file
        raise CheckpointError(
            f"{path} is not a readable gossipdl checkpoint ({type(exc).__name__}: {exc}); {WITHOUT}"
        ) from None
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        raise CheckpointError(f"{path} is not a gossipdl checkpoint (format {FORMAT}); {WITHOUT}")
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path} has no valid step ({step!r}); {WITHOUT}")
    for key, ours in (("peer", peer), ("swarm", swarm)):
        theirs = state.get(key)
        if ours is not None and theirs is not None and theirs != ours:
            raise CheckpointError(
                f"{path} is the checkpoint of {key} {theirs!r}, not of {key} {ours!r}: it was "
                f"copied from elsewhere; put back this {key}'s own, or {WITHOUT}"
            )
    try:
        if not isinstance(state.get("model"), dict):
            raise ValueError("it holds no model state")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(
            f"{path} was saved from a different model or optimizer than this config builds "
            f"({type(exc).__name__}: {exc}); {WITHOUT}"
        ) from None
    return step
