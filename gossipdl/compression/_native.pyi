"""Types of the C kernels in ``_native.c`` (built by ``setup.py`` when a C compiler is there)."""

import numpy as np

def sign_encode(
    x: np.ndarray, bits: np.ndarray, block: int = ..., sums: np.ndarray | None = ...
) -> float: ...
def sign_expand(
    bits: np.ndarray, scales: np.ndarray, out: np.ndarray, block: int = ...
) -> None: ...
def ternary_encode(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    out: np.ndarray,
    seed: int,
    block: int = ...,
) -> None: ...
def ternary_decode(
    packed: np.ndarray, scales: np.ndarray, out: np.ndarray, block: int = ...
) -> None: ...
def qsgd_encode(
    x: np.ndarray,
    packed: np.ndarray,
    norms: np.ndarray,
    out: np.ndarray,
    levels: int,
    seed: int,
    block: int = ...,
) -> None: ...
def qsgd_decode(
    packed: np.ndarray, norms: np.ndarray, out: np.ndarray, levels: int, block: int = ...
) -> int: ...
def uniform_encode(
    x: np.ndarray,
    packed: np.ndarray,
    lo: np.ndarray,
    step: np.ndarray,
    out: np.ndarray,
    bits: int,
    block: int = ...,
) -> None: ...
def uniform_decode(
    packed: np.ndarray,
    lo: np.ndarray,
    step: np.ndarray,
    out: np.ndarray,
    bits: int,
    block: int = ...,
) -> None: ...
def use_isa(name: str = ...) -> str: ...
def subset_mark(
    draws: np.ndarray, numel: int, bitmap: np.ndarray, found: int, want: int
) -> int: ...
def subset_positions(bitmap: np.ndarray, numel: int, value: int, out: np.ndarray) -> None: ...
def magnitude_at_least(x: np.ndarray, tau: float, idx: np.ndarray, val: np.ndarray) -> int: ...
def densify(idx: np.ndarray, val: np.ndarray, out: np.ndarray) -> None: ...
def low_rank_product(
    p: np.ndarray, qt: np.ndarray, out: np.ndarray, rows: int, cols: int
) -> None: ...
