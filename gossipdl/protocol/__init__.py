"""The gossip protocol as state machines, with no I/O: no sockets, threads, sleeps or clocks.

Engines feed it events (a decoded message came, time is t, the local step
finished) and carry out what it returns (send these frames, wake me at t, use
this model). The real engine (:mod:`gossipdl.peers`) drives it with ZeroMQ and
the wall clock; the simulator (:mod:`gossipdl.sim`) with an in-memory network
and a virtual clock. The baselines' protocols are such machines too: the ring
all-reduce (:mod:`gossipdl.protocol.ring`) and the parameter server's shards and
workers (:mod:`gossipdl.protocol.ps_server`, :mod:`gossipdl.protocol.ps_worker`).
"""
