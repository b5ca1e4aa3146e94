"""The protocol's message kinds, the meta keys it adds, and the limits on what a sender may
make a peer hold (each drop counted by its reason)."""

from __future__ import annotations

from gossipdl.transport.wire import NONCE

MODEL_KINDS = frozenset({"params", "public", "reply", "walk", "model"})  # counted as transmissions
LOSSY_KINDS = frozenset({"params", "public", "reply", "walk"})  # ``loss`` may drop these
COMPRESSED_KINDS = frozenset({"params", "reply", "walk"})  # travel through the swarm's codec
WALK_AGE = "_age"  # meta key of a walking model's age, next to the codec's own meta
SYNC_AT = "_sync_at"  # meta key of the sync rounds a dynamic-trigger message announces
TABLE = "_table"  # meta key of the sender's member table digest (MemberTable.digest)
TABLE_KINDS = frozenset({"alive", "params", "public", "quiet", "reply"})  # the kinds that carry it
PEER_META = frozenset({WALK_AGE, SYNC_AT, NONCE, TABLE})  # the peer's meta keys, not the codec's
MAX_ALARMS = 64  # more pending syncs than this in one message is a malformed message
MAX_WALKS = 64  # walking models queued for the next merge; more are dropped
MAX_RESYNC_AHEAD = 100_000  # a resync asked for a round further ahead: ``resync_too_far``
MAX_RESYNCS_PER_SENDER = 8  # resyncs one neighbour may have pending: ``too_many_pending``
RESYNC_LEAD = 2  # a resync asks for the neighbours' dense copies this many rounds ahead
