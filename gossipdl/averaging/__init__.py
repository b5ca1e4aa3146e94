"""How peers combine models: averaging strategies behind one small interface."""

from gossipdl.averaging.base import Arrival, Averager, Round
from gossipdl.averaging.broadcast import Broadcast
from gossipdl.averaging.choco import Choco, default_gamma
from gossipdl.averaging.dense import DenseGossip
from gossipdl.averaging.registry import (
    available_algorithms,
    build_averager,
    register_algorithm,
    resolve_algorithm,
)

__all__ = [
    "Arrival",
    "Averager",
    "Broadcast",
    "Choco",
    "DenseGossip",
    "Round",
    "available_algorithms",
    "build_averager",
    "default_gamma",
    "register_algorithm",
    "resolve_algorithm",
]
