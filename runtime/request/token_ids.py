"""Token ids in the request protocol's packed form (no torch): little-endian uint32, four bytes an id.

A prompt of 512 ids decodes from msgpack's list form in ~15 µs on the CI box and then costs the engine ~40 µs to
check (every id an int, in range); packed, it unpacks into a ``TokenIds`` list whose ids are known to be
non-negative integers and whose maximum was taken in C, so the engine's check is one comparison. On a GPU
worker this runs in the request reader beside the step loop, for every request of a burst."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import numpy as np

_CODE = "I" if array("I").itemsize == 4 else "L"  # a C unsigned int of four bytes (every platform we run on)


class TokenIds(list):
    """A list of token ids unpacked from the packed form: non-negative ints, with their maximum (-1: empty)."""

    __slots__ = ("max_id",)

    def __init__(self, ids: Iterable[int] = (), max_id: int = -1):
        super().__init__(ids)
        self.max_id = max_id


def pack_token_ids(ids: list[int]) -> bytes | None:
    """The packed form, or None when an id is not an integer in [0, 2**32) (sent as a list; the worker rejects it
    with its own check)."""
    try:
        packed = array(_CODE, ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> TokenIds:
    """Raises ValueError for a length that is not a multiple of four."""
    if len(data) % 4:
        raise ValueError(f"packed token ids of {len(data)} bytes (not a multiple of 4)")
    unpacked = array(_CODE)
    unpacked.frombytes(data)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return TokenIds(unpacked.tolist(), int(np.frombuffer(data, dtype="<u4").max()) if data else -1)
