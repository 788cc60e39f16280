"""The file store: upload limits, atomic publication, ids that cannot leave the directory."""

from __future__ import annotations

import io

import pytest

from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.services.batch.files import FileStore, FileTooLarge, valid_file_id


def upload(store, data: bytes, **limits):
    kw = {"max_bytes": 1 << 20, "max_lines": 100, **limits}
    return store.save_upload(io.BytesIO(data), "in.jsonl", **kw)


def test_upload_get_content_delete(tmp_path):
    store = FileStore(tmp_path / "files")
    meta = upload(store, b'{"a": 1}\n\n{"b": 2}')
    assert meta["object"] == "file" and meta["purpose"] == "batch" and meta["bytes"] == 18
    assert meta["filename"] == "in.jsonl" and valid_file_id(meta["id"])
    assert store.get(meta["id"]) == meta
    assert store.content_path(meta["id"]).read_bytes() == b'{"a": 1}\n\n{"b": 2}'
    assert store.delete(meta["id"]) and store.get(meta["id"]) is None and store.content_path(meta["id"]) is None
    assert not store.delete(meta["id"])
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == []  # no temp files left behind


@pytest.mark.parametrize(
    ("data", "limits", "error", "what"),
    [
        (b"x" * 5000, {"max_bytes": 4096}, FileTooLarge, "exceeds"),
        (b"{}\n" * 4, {"max_lines": 3}, InvalidRequestError, "more than 3"),
        (b"{}\n" * 3 + b"{}", {"max_lines": 3}, InvalidRequestError, "more than 3"),  # a last line without newline
        (b'{"a": "\xff"}\n', {}, InvalidRequestError, "UTF-8"),
        (b"\n  \n", {}, InvalidRequestError, "empty"),
    ],
)
def test_upload_limits(tmp_path, data, limits, error, what):
    store = FileStore(tmp_path)
    with pytest.raises(error, match=what):
        upload(store, data, **limits)
    assert list(tmp_path.iterdir()) == []  # nothing published, no temp file


def test_limits_count_requests_not_blank_lines(tmp_path):
    meta = upload(FileStore(tmp_path), b"{}\n\n\n{}\n   \n{}\n", max_lines=3)
    assert meta["bytes"] == 15


def test_utf8_split_across_read_chunks_is_fine(tmp_path, monkeypatch):
    import kernellab.services.batch.files as files

    monkeypatch.setattr(files, "_CHUNK", 3)
    meta = upload(FileStore(tmp_path), '{"t": "héllo wörld"}\n'.encode())
    assert FileStore(tmp_path).content_path(meta["id"]).read_text() == '{"t": "héllo wörld"}\n'


@pytest.mark.parametrize("bad", ["../etc/passwd", "file-../../x", "file-ABC", "", "file-" + "0" * 23])
def test_ids_are_checked_before_they_become_paths(tmp_path, bad):
    store = FileStore(tmp_path)
    assert store.get(bad) is None and store.content_path(bad) is None and not store.delete(bad)


def test_outputs_are_rewritten_idempotently(tmp_path):
    store = FileStore(tmp_path)
    fid = "file-" + "ab" * 12
    first = store.save_output(fid, "b_output.jsonl", ['{"x":1}', '{"x":2}'])
    again = store.save_output(fid, "b_output.jsonl", ['{"x":1}', '{"x":2}'])
    assert first["purpose"] == again["purpose"] == "batch_output" and first["bytes"] == again["bytes"] == 16
    assert store.content_path(fid).read_text() == '{"x":1}\n{"x":2}\n'
