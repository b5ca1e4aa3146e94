"""The simulated engine: virtual peers on a virtual clock over an in-memory network.

:class:`Scheduler` (virtual time, deterministic event order) and :class:`SimNetwork`
(the real encoded frames over device links, with partitions, clogs, deaths, drops,
duplicates and reordering injected) carry the swarms of :mod:`gossipdl.sim.engine`
(gossip; :mod:`~gossipdl.sim.ring` and :mod:`~gossipdl.sim.ps` for the baselines), which
joins (:mod:`~gossipdl.sim.joins`) and fault schedules (:mod:`~gossipdl.sim.faults`)
drive. The fault search draws random schedules (:mod:`~gossipdl.sim.random_faults`) and
judges each run by the protocol's invariants (:mod:`~gossipdl.sim.invariants`).
"""

from gossipdl.sim.clock import ClockError, Scheduler, Timer
from gossipdl.sim.network import DROP_REASONS, NetworkError, SimNetwork

__all__ = [
    "DROP_REASONS",
    "ClockError",
    "NetworkError",
    "Scheduler",
    "SimNetwork",
    "Timer",
]
