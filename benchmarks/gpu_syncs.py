"""GPU syncs: where a training step and a gossip round make the host wait for the GPU.

What it measures
    ``--peers`` peers on a ring (2 by default) in one process, each a real protocol core
    (:class:`GossipCore`) with its model, SGD with momentum and averager on ``--device``,
    trade the real wire frames (as bytes, as the simulator does) for ``--steps`` steps:
    forward, backward and the optimizer step (the loss kept as a tensor, as a peer does
    between metrics lines), the round opened on the parameters' vector (held as a ``Peer``
    holds it: :class:`FlatParameters`), the neighbours' messages taken in, the round
    polled and the new model written back. Every operation that makes the host wait for
    the GPU is reported by
    ``torch.cuda.set_sync_debug_mode("warn")``; each is counted by the gossipdl line that
    called it, per step of the whole ring, after ``--warmup`` steps (the first round's
    vouch and the warm-up's one-off work are left out). The ``dense-<defence>`` settings
    audit the Byzantine-robust rules (run them with ``--peers 4``: two neighbours). The same
    run checks that every tensor the averager keeps (public copies, sums, residuals) is
    on the peer's device.

    The payload's copy to the host is a sync by design (a message's bytes leave from host
    memory); every other site is work that could stay queued on the device.

Run
    python benchmarks/gpu_syncs.py --device cuda
    python benchmarks/gpu_syncs.py --device cuda --json runs/bench-gpu-syncs.json
    python benchmarks/gpu_syncs.py --device cuda --peers 4 --only dense-clip,dense-balance
    python benchmarks/gpu_syncs.py --quick       # on a CPU: the path runs, no syncs to count

JSON (``--json FILE``): ``{"benchmark": "gpu_syncs", "rows": [...], "meta": {...}}``; one
row per setting and call site: ``setting``, ``site`` (file:line and function, or
``-`` for a setting with none), ``per_step`` (syncs per step) and ``what`` (that
line's source); ``meta`` holds each setting's ``placement`` (tensor name: device).
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    Column,
    add_only_option,
    at_least,
    benchmark_parser,
    check_device,
    report,
    run_script,
)

from gossipdl.averaging import build_averager, parse_trigger
from gossipdl.averaging.local_optimizer import current_lr, mask_momentum
from gossipdl.models.parameters import FlatParameters
from gossipdl.peers.device import pick_device
from gossipdl.protocol.core import GossipCore, Send, Settings
from gossipdl.protocol.membership import Member, MemberTable

SETTINGS = {  # name: (algorithm, codec, trigger, defence)
    "dense": ("dense", "none", "always", "none"),
    "choco-topk": ("choco", "topk:0.01", "always", "none"),
    "choco-sign": ("choco", "sign", "always", "none"),
    "choco-qsgd": ("choco", "qsgd:16", "always", "none"),
    "dense-fp16-dynamic": ("dense", "fp16", "dynamic:0.01:4", "none"),
    "dense-clip": ("dense", "none", "always", "clip"),
    "dense-trimmed": ("dense", "none", "always", "trimmed:1"),
    "dense-balance": ("dense", "none", "always", "balance:0.5:3"),
}
PACKAGE = str(Path(__file__).resolve().parents[1] / "gossipdl")


def _site(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """The innermost gossipdl frame of ``stack`` (the line of ours that asked for the sync):
    where it is, and its source."""
    frame = next((f for f in reversed(stack) if f.filename.startswith(PACKAGE)), stack[-1])
    where = Path(frame.filename)
    if frame.filename.startswith(PACKAGE):
        where = where.relative_to(Path(PACKAGE).parent)
    return f"{where}:{frame.lineno} {frame.name}", (frame.line or "").strip()


class _Peer:
    """One peer's model, optimizer and protocol core."""

    def __init__(
        self, me: int, peers: int, model: torch.nn.Module, setting: tuple[str, str, str, str]
    ) -> None:
        algorithm, codec, trigger, defence = setting
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.flat_params = FlatParameters(list(model.parameters()))  # as a Peer holds them
        self.params = self.flat_params.params
        members = MemberTable([Member(i, f"inproc://{i}", 0) for i in range(peers)], 16)
        self.core = GossipCore(
            me,
            members,
            averager=build_averager(algorithm, codec, seed=0, defence=defence),
            trigger=parse_trigger(trigger),
            settings=Settings(topology="ring"),
            model=self.flat_params.copy(),
        )

    def train(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def _deliver(peers: list[_Peer], sender: int, sends: list[Send], now: float) -> None:
    """Carry ``sends`` to their receivers as bytes, and whatever those answer, at once."""
    queue = [(sender, s) for s in sends]
    while queue:
        _, send = queue.pop(0)
        frames = [f if type(f) is bytes else bytes(memoryview(f)) for f in send.frames]
        answers = peers[send.to].core.receive(now, frames)
        queue.extend((send.to, a) for a in answers)


def _placement(peer: _Peer) -> dict[str, str]:
    """Where the averager's kept tensors and the model live."""
    averager = peer.core.averager
    found = {"model": str(peer.params[0].device)}
    for name, value in vars(averager).items():
        if isinstance(value, torch.Tensor):
            found[f"averager.{name}"] = str(value.device)
    codec = averager.codec
    for name, value in vars(codec).items():
        if isinstance(value, torch.Tensor):
            found[f"codec.{name}"] = str(value.device)
    return found


def audit(
    name: str, device: torch.device, steps: int, warmup: int, width: int, count: int = 2
) -> tuple[Counter[str], dict[str, str], dict[str, str]]:
    """Syncs by call site over ``steps`` steps of setting ``name`` on a ring of ``count``
    peers (all of them together); their warning texts; where peer 0's tensors live at the
    end."""
    torch.manual_seed(0)
    template = torch.nn.Sequential(
        torch.nn.Linear(40, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 10),
    ).to(device)  # fmt: skip
    peers = [_Peer(i, count, copy.deepcopy(template), SETTINGS[name]) for i in range(count)]
    for peer in peers:
        peer.core.sync_at_step(warmup + steps)
    data = [(torch.randn(32, 40, device=device), torch.randint(0, 10, (32,), device=device))]
    sites: Counter[str] = Counter()
    texts: dict[str, str] = {}
    losses: list[torch.Tensor] = []

    def show(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        if "synchroniz" not in str(message):  # another warning: not ours to count
            return
        site, source = _site(traceback.extract_stack()[:-1])
        sites[site] += 1
        texts.setdefault(site, source[:80])

    for step in range(1, warmup + steps + 1):
        counting = step > warmup
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            if counting:
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn") if device.type == "cuda" else None
            try:
                now = float(step)
                for peer in peers:
                    losses.append(peer.train(*data[0]))
                opened = []
                for i, peer in enumerate(peers):
                    if peer.core.trigger.ends_round(step):
                        averager = peer.core.averager
                        flat = peer.flat_params.round_input(averager.sends_memory_of)
                        sends = peer.core.open_round(now, flat, None, current_lr(peer.optimizer))
                        mask_momentum(peer.optimizer, peer.params, averager.sent_mask())
                        opened.append((i, sends))
                for i, sends in opened:
                    _deliver(peers, i, sends, now)
                for i, _ in opened:
                    progress = peers[i].core.poll(now)
                    _deliver(peers, i, progress.sends, now)
                    if progress.model is None:
                        progress = peers[i].core.poll(now)
                    assert progress.model is not None, (
                        f"{name}: peer {i}'s round {step} did not end"
                    )
                    peers[i].flat_params.load_(progress.model)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
    torch.stack(losses).sum().item()  # the losses were real work; read once, at the end
    per_step = Counter({site: count / steps for site, count in sites.items()})
    return per_step, texts, _placement(peers[0])


def main() -> None:
    parser = benchmark_parser(__doc__, quick="a 64-wide MLP, 4 steps")
    parser.add_argument("--device", default="cuda", help="the GPU to audit (cpu: the path alone)")
    parser.add_argument("--steps", type=at_least(1), default=20, help="steps counted")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="steps first, not counted")
    parser.add_argument("--width", type=at_least(1), default=1024, help="the MLP's hidden width")
    parser.add_argument(
        "--peers", type=at_least(2), default=2, help="peers on the ring (a defence's rules want 3+)"
    )
    add_only_option(parser, list(SETTINGS))
    args = parser.parse_args()
    if args.quick:
        args.device = "cpu" if not torch.cuda.is_available() else args.device
        args.steps, args.width = 4, 64
    check_device(parser, args.device)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows: list[dict[str, Any]] = []
    placement: dict[str, dict[str, str]] = {}
    for name in args.only or list(SETTINGS):
        sites, texts, placed = audit(name, device, args.steps, args.warmup, args.width, args.peers)
        placement[name] = placed
        if not sites:
            rows.append({"setting": name, "site": "-", "per_step": 0.0, "what": ""})
        for site, per_step in sites.most_common():
            rows.append({"setting": name, "site": site, "per_step": per_step, "what": texts[site]})
    off = {
        n: {k: v for k, v in p.items() if v != str(device) and not v.startswith(device.type + ":")}
        for n, p in placement.items()
    }
    columns = [
        Column("setting", "setting"),
        Column("site", "gossipdl line that synced"),
        Column("per_step", "syncs/step", "{:.2f}"),
        Column("what", "the line"),
    ]
    report(
        "gpu_syncs",
        f"Host syncs per step on {device} ({args.peers} peers, one process, sync debug mode)",
        columns,
        rows,
        {
            "device": str(device),
            "steps": args.steps,
            "warmup": args.warmup,
            "width": args.width,
            "peers": args.peers,
            "placement": placement,
            "off_device": off,
        },
        args.json,
        notes=[
            f"tensors off {device}: {off}"
            if any(off.values())
            else f"every kept tensor is on {device}"
        ],
    )


if __name__ == "__main__":
    run_script(main)
