"""Token ids in the request protocol's packed form (no torch): little-endian uint32, four bytes an id.

A prompt of 512 ids decodes from msgpack's list form in ~15 µs on the CI box and then costs the engine ~40 µs to
check (every id an int, in range); packed, it unpacks into a ``TokenIds`` array (no Python int made per id) whose ids are known to be
non-negative integers and whose maximum was taken in C, so the engine's check is one comparison. On a GPU
worker this runs in the request reader beside the step loop, for every request of a burst."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import numpy as np

_CODE = "I" if array("I").itemsize == 4 else "L"  # a C unsigned int of four bytes (every platform we run on)


class TokenIds(array):
    """Token ids unpacked from the packed form: non-negative ints in a C array of uint32, with their maximum (-1:
    empty). A sequence of ints as a list is (length, indexing, iteration; a slice is a plain array), equal to the
    list of the same ids, but no container: a list's ids are references that each young garbage collection walks
    one by one (a burst of 64 prompts of 512 tokens held 32,768 of them in the worker while their requests
    lived)."""

    __slots__ = ("max_id",)
    max_id: int
    __hash__ = None  # mutable, as a list

    def __new__(cls, ids: Iterable[int] | bytes = (), max_id: int = -1) -> TokenIds:
        self = super().__new__(cls, _CODE)
        if isinstance(ids, bytes):
            self.frombytes(ids)
        else:
            self.extend(ids)
        self.max_id = max_id
        return self

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __reduce_ex__(self, protocol):  # pickles keep the type and the maximum
        return type(self), (self.tobytes(), self.max_id)

    def __copy__(self) -> TokenIds:  # so do copies (array's own make a plain array)
        return type(self)(self.tobytes(), self.max_id)

    def __deepcopy__(self, memo: dict) -> TokenIds:
        return self.__copy__()

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r}, max_id={self.max_id})"


def pack_token_ids(ids: list[int]) -> bytes | None:
    """The packed form, or None when an id is not an integer in [0, 2**32) (sent as a list; the worker rejects it
    with its own check)."""
    if isinstance(ids, TokenIds) and sys.byteorder == "little":  # already the packed form's ids
        return ids.tobytes()
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
    unpacked = TokenIds(data, int(np.frombuffer(data, dtype="<u4").max()) if data else -1)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked
