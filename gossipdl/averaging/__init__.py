"""How peers combine models: averaging strategies behind one small interface."""

from gossipdl.averaging.base import Arrival, Averager, Round, SharedDecodes
from gossipdl.averaging.beer import Beer
from gossipdl.averaging.broadcast import Broadcast
from gossipdl.averaging.choco import Choco, auto_gamma
from gossipdl.averaging.dense import DenseGossip
from gossipdl.averaging.gossip_learning import GossipLearning, age_weighted_merge
from gossipdl.averaging.power_gossip import PowerGossip
from gossipdl.averaging.registry import (
    available_algorithms,
    build_averager,
    register_algorithm,
    resolve_algorithm,
)
from gossipdl.averaging.triggers import (
    Trigger,
    TriggerError,
    check_overlap,
    check_trigger,
    parse_trigger,
)

__all__ = [
    "Arrival",
    "Averager",
    "Beer",
    "Broadcast",
    "Choco",
    "DenseGossip",
    "GossipLearning",
    "PowerGossip",
    "Round",
    "SharedDecodes",
    "Trigger",
    "TriggerError",
    "age_weighted_merge",
    "auto_gamma",
    "available_algorithms",
    "build_averager",
    "check_overlap",
    "check_trigger",
    "parse_trigger",
    "register_algorithm",
    "resolve_algorithm",
]
