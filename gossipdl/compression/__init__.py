"""Codecs for gossip messages: sparsifiers, quantizers, index coders, PowerSGD, error feedback.

Pure tensor code (torch, numpy, msgpack, stdlib; nothing else of gossipdl).
Build a codec from a spec string, encode a flat float32 tensor on any device,
send the payload's arrays and meta, decode on the other side::

    >>> import torch
    >>> from gossipdl.compression import build_codec
    >>> codec = build_codec("topk:0.01+fp16+ef")
    >>> x = torch.randn(100_000)
    >>> payload, sent = codec.encode(x)            # sent: what the receiver will hold
    >>> payload.nbytes < x.numel() * 4 // 100      # 1,000 fp16 values + coded indices
    True
    >>> bool(torch.equal(codec.decode(payload, x.numel(), "cpu"), sent))
    True

Spec grammar (see :mod:`gossipdl.compression.registry`):
``[sparsifier][+value codec][+index coder][+ef]`` or ``whole-vector codec[+ef]``,
e.g. ``topk:0.01``, ``topk:0.01+qsgd:16+delta-golomb``, ``threshold:auto+sign``,
``randomk:0.01``, ``powersgd:2+ef``, ``fp16``, ``sign+ef``, ``uniform:4``,
``ternary``, ``none``.
"""

from gossipdl.compression.base import Codec, CodecError, Payload, ValueCodec
from gossipdl.compression.feedback import ErrorFeedback
from gossipdl.compression.registry import (
    DEFAULT_INDEX_CODER,
    CodecFactory,
    available_codecs,
    build_codec,
    builtin_codec,
    register_codec,
    stage_names,
)

__all__ = [
    "DEFAULT_INDEX_CODER",
    "Codec",
    "CodecError",
    "CodecFactory",
    "ErrorFeedback",
    "Payload",
    "ValueCodec",
    "available_codecs",
    "build_codec",
    "builtin_codec",
    "register_codec",
    "stage_names",
]
