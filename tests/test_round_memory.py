"""A gossip round's memory: what one round of an averager holds at its peak, beyond the
model, the optimizer's state and the public copies, in model-sized buffers.

Measured, not estimated: in a forked worker whose malloc maps every large block (so a
freed one leaves the resident set) and that has no transparent huge pages (the kernel
counts a 2 MB fault's pages late, which hid whole buffers), the kernel's peak resident
size is reset before
the round (``/proc/self/clear_refs``), the recycler's free blocks are dropped (a
recycled buffer counts as much as a fresh one), and the peak's rise is read after it.
The round is this peer's: its outgoing message, the decoding of its neighbour's, and
the merge; the neighbour's own work is done before the window opens.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from gossipdl.averaging import Arrival, Round, build_averager
from gossipdl.compression import _kernels
from gossipdl.experiments import forking

NUMEL = 5_000_000  # 20 MB: above the recycler's smallest block
M_MMAP_THRESHOLD = -3
PR_SET_THP_DISABLE = 41


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+)", status.read())[1]) * 1024  # type: ignore[index]


def _round_peaks(algorithm: str, codec: str, rounds: int) -> list[float]:
    """Each round's peak resident rise, in buffers of NUMEL float32 (in a worker)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)
    torch.manual_seed(0)
    mine, theirs = build_averager(algorithm, codec), build_averager(algorithm, codec)
    x = torch.randn(NUMEL)
    y = x.clone()  # one start: CHOCO's first round vouches for it instead of sending it
    peaks = []
    for t in range(rounds):
        rnd = Round(t, {1: 0.5}, 0.5, resync=t == 0)
        sent = theirs.outgoing(y, rnd)
        dense = t == 0 and mine.uses_public_copies
        if dense:
            sent = theirs.vouch()
        _kernels._recycler._free.clear()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident size starts again from here
        base = _status("VmRSS")
        payload = mine.outgoing(x, rnd)
        value = mine.decode(sent, dense, NUMEL, torch.device("cpu"))
        new = mine.incoming(x, rnd, {1: Arrival(0.5, value, t, dense)}, [])
        peaks.append((_status("VmHWM") - base) / (4 * NUMEL))
        assert t == 0 or not torch.equal(new, x), "the round mixed nothing"
        del payload, value, sent
        x, y = new + 0.01 * torch.randn(NUMEL), y + 0.01 * torch.randn(NUMEL)
        del new
    return peaks


@pytest.mark.parametrize(
    ("algorithm", "codec", "bound"),
    [("choco", "topk:0.01", 1.6), ("dense", "none", 2.1), ("choco", "sign", 2.1)],
)
def test_a_round_holds_at_most_two_model_sized_buffers(
    algorithm: str, codec: str, bound: float
) -> None:
    """After the first round (which builds CHOCO's public copies: 10 buffers at its peak
    for top-k, 4 for sign), a round holds the neighbour's decoded message and the merged
    model: two buffers (x + γ(s − x̂) as three temporaries made it three). CHOCO with
    top-k holds less: the neighbours' kept values are added where they belong, never
    made dense, so its peak is x − x̂ and the selection's masks (a byte per value)."""
    with forking.context().Pool(1) as pool:
        peaks = pool.apply(_round_peaks, (algorithm, codec, 4))
    assert all(peak <= bound for peak in peaks[1:]), peaks
    assert max(peaks[1:]) > 1.0, peaks  # the window sees the round's buffers at all
