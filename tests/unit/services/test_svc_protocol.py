import copy
import gc
import pickle

import msgpack
import pytest

from kernellab.services.queue.keys import Keys
from kernellab.services.queue.protocol import (
    PROTOCOL_VERSION,
    CancelMessage,
    ErrorMessage,
    Heartbeat,
    OutputChunk,
    ProtocolError,
    RequestMessage,
    decode,
    encode,
    entry,
    from_entry,
)

MESSAGES = [
    RequestMessage(
        "chatcmpl-1", 1, "smollm2-135m", [1, 2, 3], {"max_tokens": 4, "stop": ["x"]}, "batch", 12.5, 10.0, 2, True
    ),
    OutputChunk(
        "chatcmpl-1",
        0,
        5,
        [7, 8],
        [[7, -0.1, [[7, -0.1], [9, -2.0]]], [8, -0.2, []]],
        True,
        "stop",
        "x",
        3,
        7,
        16,
        "w1",
    ),
    ErrorMessage("cmpl-2", 0, 400, "bad", "invalid_request_error", "context_length_exceeded", "max_tokens", "w2"),
    CancelMessage("cmpl-3", None, "disconnect"),
    CancelMessage("cmpl-3", 2),
    Heartbeat("w1", "smollm2-135m", 123.0, 42, 3, 1, 0.25, 8192, "http://x/metrics", True, {"active": 4}),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message)) == message
    assert from_entry(entry(message)) == message
    assert from_entry({k.decode(): v for k, v in entry(message).items()}) == message


def test_engine_request_id_joins_id_and_choice():
    assert MESSAGES[0].engine_id == "chatcmpl-1-1"


def test_other_versions_are_rejected():
    body = msgpack.unpackb(encode(MESSAGES[3]))
    for version in (PROTOCOL_VERSION + 1, 0, None, "1"):
        body["v"] = version
        with pytest.raises(ProtocolError, match="version"):
            decode(msgpack.packb(body))


def test_unknown_kind_missing_fields_and_garbage_are_rejected():
    with pytest.raises(ProtocolError, match="kind"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "k": "telepathy"}))
    with pytest.raises(ProtocolError, match="malformed"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "k": "cancel"}))
    with pytest.raises(ProtocolError):
        decode(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError):
        from_entry({b"other": b""})


def test_hop_restriction():
    with pytest.raises(ProtocolError, match="unexpected"):
        decode(encode(MESSAGES[3]), RequestMessage)
    assert decode(encode(MESSAGES[1]), (OutputChunk, ErrorMessage)) == MESSAGES[1]


def test_unknown_fields_from_a_newer_minor_writer_are_ignored():
    body = msgpack.unpackb(encode(MESSAGES[3]))
    body["future_field"] = 1
    assert decode(msgpack.packb(body)) == MESSAGES[3]


def test_cancel_matching():
    assert CancelMessage("a").matches("a", 3)
    assert CancelMessage("a", 1).matches("a", 1)
    assert not CancelMessage("a", 1).matches("a", 0)
    assert not CancelMessage("a").matches("b", 0)


def test_keys_share_one_prefix_and_split_by_model():
    k = Keys("kl:", "m")
    names = [
        *k.request_streams,
        k.output("x-0"),
        k.meta("x"),
        k.cancel,
        k.dead_letter,
        k.workers,
        k.heartbeat("w"),
        k.wake("g"),
    ]
    assert all(n.startswith("kl:") for n in names)
    assert len(set(names)) == len(names)
    assert k.requests("interactive") != Keys("kl:", "other").requests("interactive")
    with pytest.raises(ValueError):
        k.requests("urgent")


def test_prompt_ids_travel_packed_and_come_back_as_a_checked_list():
    from kernellab.runtime.request.token_ids import TokenIds

    ids = [0, 5, 151_935, 2**32 - 1, 7]
    msg = RequestMessage("cmpl-p", 0, "m", ids, {"max_tokens": 2})
    body = msgpack.unpackb(encode(msg))
    assert body["prompt_token_ids"] == b"".join(i.to_bytes(4, "little") for i in ids)  # four bytes an id
    got = decode(encode(msg))
    assert got == msg and isinstance(got.prompt_token_ids, TokenIds) and got.prompt_token_ids.max_id == 2**32 - 1
    assert type(got.prompt_token_ids[0]) is int and got.prompt_token_ids[1:3].tolist() == [5, 151_935]
    # a C array, not a list: the collector's walk of it does not visit an id (just its type and its maximum)
    assert not any(isinstance(r, int) and r in (0, 5, 7) for r in gc.get_referents(got.prompt_token_ids))
    assert len(gc.get_referents(got.prompt_token_ids)) <= 2
    again = copy.deepcopy(got.prompt_token_ids)
    assert type(again) is TokenIds and again.max_id == 2**32 - 1 and again == ids
    assert pickle.loads(pickle.dumps(got)) == msg


@pytest.mark.parametrize("ids", [[1, -1], [2**32], [1, 2.5], [1, "2"], []])
def test_prompt_ids_that_do_not_pack_travel_as_a_list(ids):
    """An id outside uint32 or not an integer goes as msgpack's list; the worker's own check rejects it."""
    from kernellab.runtime.request.token_ids import TokenIds

    got = decode(encode(RequestMessage("cmpl-l", 0, "m", ids, {})))
    assert got.prompt_token_ids == ids and (not isinstance(got.prompt_token_ids, TokenIds) or not ids)


def test_a_list_prompt_from_an_older_gateway_and_a_torn_packed_one():
    body = msgpack.unpackb(encode(RequestMessage("cmpl-o", 0, "m", [3, 4], {})))
    body["prompt_token_ids"] = [3, 4]  # what gateways wrote before the packed form
    assert decode(msgpack.packb(body)).prompt_token_ids == [3, 4]
    body["prompt_token_ids"] = b"\x01\x00\x00"  # not a multiple of four bytes
    with pytest.raises(ProtocolError, match="multiple of 4"):
        decode(msgpack.packb(body))
