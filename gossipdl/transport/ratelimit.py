"""Per-connection rate limiting: a token bucket for every sender connection.

A flood from one connection (a bug, or a stranger) is dropped before it is
decoded, so it costs the receiver almost nothing and cannot starve the
messages of well-behaved peers, which have buckets of their own.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_MESSAGE_RATE = 20_000.0  # messages per second per connection; a gossip round sends a few


class RateLimiter:
    """Token buckets keyed by connection: ``rate`` messages per second, bursts up to one
    second's worth. ``rate`` 0 lets everything through. At most ``max_senders`` buckets are
    kept (the least recently used one is forgotten), so strangers cannot grow it without bound.

    Example:
        >>> limiter = RateLimiter(rate=2)
        >>> [limiter.allow(b"a", now=0.0) for _ in range(3)], limiter.allow(b"b", now=0.0)
        ([True, True, False], True)
        >>> limiter.allow(b"a", now=0.5)
        True
    """

    def __init__(self, rate: float = DEFAULT_MESSAGE_RATE, max_senders: int = 10_000) -> None:
        if rate < 0:
            raise ValueError(f"message rate {rate} must not be negative (0: no limit)")
        self.rate = rate
        self.max_senders = max_senders
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # tokens, time

    def allow(self, key: bytes, now: float) -> bool:
        """Whether one more message from ``key`` fits its bucket (and take a token if so)."""
        if self.rate == 0:
            return True
        tokens, last = self._buckets.pop(key, (self.rate, now))
        tokens = min(self.rate, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        return allowed
