"""The simulated engine: virtual peers on a virtual clock over an in-memory network.

Building blocks so far: :class:`Scheduler` (virtual time, deterministic event
order) and :class:`SimNetwork` (the real encoded frames over device links,
with partitions, clogs, deaths, drops, duplicates and reordering injected).
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
