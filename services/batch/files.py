"""Files of the batch API on a directory shared by the gateway and the batch workers (a compose volume).

Layout: ``{dir}/{file_id}.jsonl`` (the content) and ``{dir}/{file_id}.json`` (the OpenAI file object, plus
``owner``: the uploading tenant's API-key digest, which the API checks and never returns).
A file exists once its metadata exists: content is written first (temp name, fsync, rename) and the
metadata last; a delete removes the metadata first. So a reader never sees a file without its content,
and a crash leaves at worst an orphan content file, never a half-written one.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.services.gateway.errors import PayloadTooLarge

_ID_RE = re.compile(r"^file-[0-9a-f]{24}$")
_CHUNK = 1 << 20


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def valid_file_id(file_id: str) -> bool:
    """Ids are checked before they become paths: no traversal out of the directory."""
    return bool(_ID_RE.match(file_id))


class FileTooLarge(PayloadTooLarge):
    def __init__(self, limit: int):
        super().__init__(limit)
        self.message = f"the file exceeds the limit of {limit} bytes"


class FileStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _content(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def _meta(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def _write_atomic(self, path: Path, chunks: Iterable[bytes]) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        size = 0
        try:
            with tmp.open("wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return size

    def _publish(
        self, file_id: str, filename: str, purpose: str, size: int, created_at: int | None = None, owner: str = ""
    ) -> dict:
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": created_at or int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
            "owner": owner,
        }
        self._write_atomic(self._meta(file_id), [json.dumps(meta).encode()])
        return meta

    # ----------------------------------------------------------------- writes
    def save_upload(self, src: BinaryIO, filename: str, *, max_bytes: int, max_lines: int, owner: str = "") -> dict:
        """An uploaded batch input: UTF-8 JSONL within the size and line-count limits (blank lines do not
        count). Line contents are checked later, per line, by the batch (bad lines go to its error file)."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        lines = 0
        size = 0

        def chunks():
            nonlocal lines, size
            pending = ""
            while True:
                chunk = src.read(_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise FileTooLarge(max_bytes)
                try:
                    text = pending + decoder.decode(chunk)
                except UnicodeDecodeError:
                    raise InvalidRequestError("the file is not UTF-8 text", param="file") from None
                *full, pending = text.split("\n")
                lines += sum(1 for line in full if line.strip())
                if lines > max_lines:
                    raise InvalidRequestError(f"the file has more than {max_lines} requests (lines)", param="file")
                yield chunk
            try:
                tail = pending + decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise InvalidRequestError("the file is not UTF-8 text", param="file") from None
            if tail.strip():
                lines += 1
            if lines > max_lines:
                raise InvalidRequestError(f"the file has more than {max_lines} requests (lines)", param="file")

        file_id = new_file_id()
        written = self._write_atomic(self._content(file_id), chunks())
        if lines == 0:
            self._content(file_id).unlink()
            raise InvalidRequestError("the file has no requests (it is empty)", param="file")
        return self._publish(file_id, filename, "batch", written, owner=owner)

    def save_output(self, file_id: str, filename: str, lines: Iterable[str], owner: str = "") -> dict:
        """A batch's output or error file (``purpose: batch_output``); idempotent for a given id and lines."""
        size = self._write_atomic(self._content(file_id), (f"{line}\n".encode() for line in lines))
        return self._publish(file_id, filename, "batch_output", size, owner=owner)

    def delete(self, file_id: str) -> bool:
        if not valid_file_id(file_id):
            return False
        try:
            self._meta(file_id).unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(FileNotFoundError):
            self._content(file_id).unlink()
        return True

    # ----------------------------------------------------------------- reads
    def get(self, file_id: str) -> dict | None:
        if not valid_file_id(file_id):
            return None
        try:
            return json.loads(self._meta(file_id).read_text())
        except FileNotFoundError:
            return None

    def content_path(self, file_id: str) -> Path | None:
        if self.get(file_id) is None:
            return None
        path = self._content(file_id)
        return path if path.exists() else None
