"""The messages between gateway and workers: one versioned dataclass per hop, msgpack on the wire.

Hops:
  gateway → request stream     ``RequestMessage``  (one per choice: a request with n=2 is two messages)
  worker  → kl:out:{id}-{i}    ``OutputChunk`` | ``ErrorMessage``
  gateway → cancel stream      ``CancelMessage``
  worker  → heartbeat key      ``Heartbeat``

Invariants:
- Every encoded message is a msgpack map carrying ``v`` (``PROTOCOL_VERSION``) and ``k`` (its kind); ``decode``
  rejects another version or kind with ``ProtocolError`` instead of guessing.
- ``RequestMessage.prompt_token_ids`` travels packed (little-endian uint32 bytes) when every id fits, else as a
  list; ``decode`` reads both (a packed prompt becomes a ``TokenIds`` list that carries its maximum). Workers of
  a version that reads the packed form must be up before gateways that write it.
- ``OutputChunk.seq`` is the output index of its first token. The chunks of one choice, read in stream order
  and deduplicated by ``seq``, give every emitted token exactly once, even when a reclaiming worker and a dying
  one both wrote the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar, TypeVar, overload

import msgpack

from kernellab.runtime.request.token_ids import pack_token_ids, unpack_token_ids

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

PROTOCOL_VERSION = 1
FIELD = b"m"  # the single field of a stream entry that holds the encoded message


class ProtocolError(ValueError):
    """A message that this version of the code cannot read."""


@dataclass(frozen=True)
class RequestMessage:
    kind: ClassVar[str] = "request"
    request_id: str  # the OpenAI-visible id (chatcmpl-…/cmpl-…), shared by all choices
    index: int  # choice index
    model: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams.to_dict()
    priority: str = "interactive"  # "interactive" | "batch"
    deadline: float | None = None  # absolute time.time(); past it the request ends with finish_reason "deadline"
    created: float = 0.0
    attempt: int = 0  # times it was re-enqueued by a draining worker (adds to Redis' delivery count)
    resume: bool = False  # tokens may already be in its output stream: read them before starting

    @property
    def engine_id(self) -> str:
        return engine_request_id(self.request_id, self.index)


@dataclass(frozen=True)
class OutputChunk:
    kind: ClassVar[str] = "chunk"
    request_id: str
    index: int
    seq: int  # output index of token_ids[0]
    token_ids: list[int]
    # per token: [token_id, logprob, [[top_id, top_logprob], ...]]; None when logprobs were not asked for
    logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "deadline"
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""
    # with a choice's first token, when its request asked for them (completions' echo with logprobs): per prompt
    # token after the first, [token_id, logprob, [[top_id, top_logprob], ...]]
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class ErrorMessage:
    kind: ClassVar[str] = "error"
    request_id: str
    index: int
    status: int  # the HTTP status the gateway answers with
    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    worker: str = ""

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CancelMessage:
    kind: ClassVar[str] = "cancel"
    request_id: str
    index: int | None = None  # None: every choice of the request
    reason: str = "cancel"

    def matches(self, request_id: str, index: int) -> bool:
        return self.request_id == request_id and (self.index is None or self.index == index)


@dataclass(frozen=True)
class Heartbeat:
    kind: ClassVar[str] = "heartbeat"
    worker_id: str
    model: str
    time: float
    pid: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    max_model_len: int = 0
    metrics_url: str = ""
    draining: bool = False
    stats: dict = field(default_factory=dict)


Message = RequestMessage | OutputChunk | ErrorMessage | CancelMessage | Heartbeat
M = TypeVar("M", RequestMessage, OutputChunk, ErrorMessage, CancelMessage, Heartbeat)
_KINDS: dict[str, type[Message]] = {
    cls.kind: cls for cls in (RequestMessage, OutputChunk, ErrorMessage, CancelMessage, Heartbeat)
}
_FIELDS: dict[type, tuple] = {cls: tuple(f for f in fields(cls)) for cls in _KINDS.values()}


def engine_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def encode(message: Message) -> bytes:
    body = {"v": PROTOCOL_VERSION, "k": message.kind}
    for f in _FIELDS[type(message)]:
        body[f.name] = getattr(message, f.name)
    if isinstance(message, RequestMessage):  # packed (runtime/request/token_ids.py) where every id fits
        packed = pack_token_ids(message.prompt_token_ids)
        if packed is not None:
            body["prompt_token_ids"] = packed
    return msgpack.packb(body, use_bin_type=True)


@overload
def decode(data: bytes, expect: type[M]) -> M: ...
@overload
def decode(data: bytes, expect: tuple[type, ...] | None = None) -> Message: ...
def decode(data: bytes, expect: type | tuple[type, ...] | None = None) -> Message:
    """Decode one message; ``expect`` restricts the kinds accepted on this hop."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("a message must be a map")
    version = body.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    kind = body.get("k")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None  # an unhashable kind is unknown, not a TypeError
    if cls is None:
        raise ProtocolError(f"unknown message kind {body.get('k')!r}")
    if expect is not None and not issubclass(cls, expect):
        raise ProtocolError(f"unexpected message kind {cls.kind!r} on this hop")
    kwargs = {}
    for f in _FIELDS[cls]:
        if f.name in body:
            kwargs[f.name] = body[f.name]
    if cls is RequestMessage and isinstance(kwargs.get("prompt_token_ids"), bytes):
        try:
            kwargs["prompt_token_ids"] = unpack_token_ids(kwargs["prompt_token_ids"])
        except ValueError as exc:
            raise ProtocolError(f"malformed request message: {exc}") from None
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ProtocolError(f"malformed {cls.kind} message: {exc}") from None


def entry(message: Message) -> dict[FieldT, EncodableT]:
    """The field map of a stream entry holding ``message``."""
    return {FIELD: encode(message)}


@overload
def from_entry(fields_: dict | None, expect: type[M]) -> M: ...
@overload
def from_entry(fields_: dict | None, expect: tuple[type, ...] | None = None) -> Message: ...
def from_entry(fields_: dict | None, expect: type | tuple[type, ...] | None = None) -> Message:
    """Decode a stream entry's field map; redis-py gives ``None`` for an entry trimmed away after delivery."""
    if fields_ is None:
        raise ProtocolError("stream entry without a message field")
    data = fields_.get(FIELD)
    if data is None:
        data = fields_.get(FIELD.decode())
    if data is None:
        raise ProtocolError("stream entry without a message field")
    return decode(data, expect)
