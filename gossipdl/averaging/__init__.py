"""How peers combine models: averaging strategies behind one small interface."""

from gossipdl.averaging.base import Arrival, Averager
from gossipdl.averaging.dense import DenseGossip
from gossipdl.averaging.registry import available_algorithms, build_averager, register_algorithm

__all__ = [
    "Arrival",
    "Averager",
    "DenseGossip",
    "available_algorithms",
    "build_averager",
    "register_algorithm",
]
