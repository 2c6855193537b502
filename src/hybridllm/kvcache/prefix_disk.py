"""The disk tier of the prefix cache: one file per KV page, written atomically, checked on read.

A file is ``<address hex>.kvpage``: the magic ``HLKVPAGE``, a little-endian u32 header length, a
JSON header (format version, the chain root its address was computed under, dtype, shape, payload
bytes, and a BLAKE2b checksum of the rest of the header and the payload together), then the
payload (keys then values, row-major). The header is also checked against the page this model's
cache expects (its shape and dtype, when the tier is told them). A file that fails any check
(corrupt, truncated, a header edited even into valid JSON, another model or KV format, another
version) is never loaded: it is removed with a one-line warning and its page is computed again;
nothing read from disk raises past :meth:`DiskTier.get`. Writes go to a temporary file renamed
over the target, so a crash never leaves half a page under a real name. The directory is the
index: a restarted process finds the pages again by scanning it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path

import torch

from hybridllm.kvcache.prefix_page import KVPage

logger = logging.getLogger(__name__)

MAGIC = b"HLKVPAGE"
VERSION = 2  # 2: the checksum covers the header too
SUFFIX = ".kvpage"
_HEADER_LENGTH = struct.Struct("<I")
_MAX_HEADER = 1 << 16


def checksum(fields: dict[str, object], payload: bytes) -> str:
    """BLAKE2b of the header's fields (canonical JSON: keys sorted) followed by the payload."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical + payload, digest_size=16).hexdigest()


class DiskTier:
    """Pages on disk under a byte budget, least recently used removed first.

    Args:
        directory: where the page files live (created if missing).
        budget: bytes of page files allowed.
        root: the chain root of this model and KV format (a file made under another is foreign).
        page_shape: the (n_layers, B, Hkv, P, D) of this model's pages (None: not checked).
        page_dtype: their dtype (None: not checked).

    A directory that cannot be created or written turns the tier off with a warning
    (:attr:`enabled` False); the engine still answers, without the disk tier.
    """

    def __init__(self, directory: str | os.PathLike, budget: int, root: bytes,
                 page_shape: tuple[int, ...] | None = None, page_dtype: torch.dtype | None = None) -> None:
        self.directory = Path(directory)
        self.budget = budget
        self.root = root
        self.page_shape = page_shape
        self.page_dtype = page_dtype
        self.enabled = True
        self._files: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # address -> bytes, LRU first
        self._warned_full = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-"):
                pass
        except OSError as exc:
            logger.warning("prefix cache: the disk directory %s is not writable (%s); the disk tier is off",
                           self.directory, exc.strerror or exc)
            self.enabled = False
            return
        self._scan()

    @property
    def nbytes(self) -> int:
        """Bytes of the page files held."""
        return sum(self._files.values())

    @property
    def n_pages(self) -> int:
        """Page files held."""
        return len(self._files)

    def __contains__(self, address: bytes) -> bool:
        return address in self._files

    def get(self, address: bytes) -> KVPage | None:
        """The page at ``address``, or None (absent, or unreadable: then removed with one warning).
        Never raises: whatever is wrong with the file, the page is computed again."""
        if address not in self._files:
            return None
        path = self._path(address)
        try:
            page = self._read(path)
            os.utime(path)  # recency survives a restart
        except Exception as exc:  # a bad file must cost a recomputation, never a request
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            logger.warning("prefix cache: ignoring and removing %s: %s", path.name, reason)
            self._remove(address)
            return None
        self._files.move_to_end(address)
        return page

    def put(self, address: bytes, page: KVPage) -> bool:
        """Write ``page`` (least recently used files removed to make room); False when it is not kept."""
        if not self.enabled or address in self._files:
            return self.enabled
        payload = page.payload()
        fields = {"version": VERSION, "root": self.root.hex(), "dtype": str(page.keys.dtype).removeprefix("torch."),
                  "shape": list(page.keys.shape), "payload_bytes": len(payload)}
        header = json.dumps({**fields, "checksum": checksum(fields, payload)}).encode()
        blob = MAGIC + _HEADER_LENGTH.pack(len(header)) + header + payload
        if len(blob) > self.budget:
            self._warn_full(f"a page of {len(blob)} bytes is larger than the disk budget ({self.budget} bytes)")
            return False
        while self._files and self.nbytes + len(blob) > self.budget:
            self._remove(next(iter(self._files)))
        path = self._path(address)
        try:
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".tmp-", delete=False) as tmp:
                tmp.write(blob)
            os.replace(tmp.name, path)
        except OSError as exc:
            self._warn_full(f"writing {path.name} failed ({exc.strerror or exc})")
            Path(tmp.name).unlink(missing_ok=True)
            return False
        self._files[address] = len(blob)
        return True

    # ---- files ---------------------------------------------------------------------------
    def _path(self, address: bytes) -> Path:
        return self.directory / f"{address.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Index the page files already there, oldest use first; leftover temporaries are removed."""
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                address = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                logger.warning("prefix cache: ignoring and removing %s: not a page file name", path.name)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, address, stat.st_size))
        for _, address, size in sorted(found):
            self._files[address] = size
        while self._files and self.nbytes > self.budget:
            self._remove(next(iter(self._files)))

    def _read(self, path: Path) -> KVPage:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not a hybridllm KV page file")
        body = data[len(MAGIC):]
        if len(body) < _HEADER_LENGTH.size:
            raise ValueError("truncated header")
        (header_length,) = _HEADER_LENGTH.unpack_from(body)
        if header_length > _MAX_HEADER or len(body) < _HEADER_LENGTH.size + header_length:
            raise ValueError("truncated header")
        try:
            header = json.loads(body[_HEADER_LENGTH.size:_HEADER_LENGTH.size + header_length])
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"corrupt header ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError("corrupt header (not a JSON object)")
        if header.get("version") != VERSION:
            raise ValueError(f"format version {header.get('version')}, this engine reads {VERSION}")
        if header.get("root") != self.root.hex():
            raise ValueError("written for another model or KV format")
        payload = body[_HEADER_LENGTH.size + header_length:]
        if len(payload) != header.get("payload_bytes"):
            raise ValueError(f"truncated: {len(payload)} of {header.get('payload_bytes')} payload bytes")
        fields = {key: value for key, value in header.items() if key != "checksum"}
        if header.get("checksum") != checksum(fields, payload):
            raise ValueError("checksum mismatch (header or payload)")
        shape, dtype_name = header.get("shape"), header.get("dtype")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError(f"bad shape {shape!r}")
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype_name!r}")
        if self.page_shape is not None and tuple(shape) != tuple(self.page_shape):
            raise ValueError(f"shape {shape}, this model's pages are {list(self.page_shape)}")
        if self.page_dtype is not None and dtype != self.page_dtype:
            raise ValueError(f"dtype {dtype_name}, this model's pages are {self.page_dtype}")
        return KVPage.from_payload(payload, dtype, tuple(shape))

    def _remove(self, address: bytes) -> None:
        self._files.pop(address, None)
        try:
            self._path(address).unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("prefix cache: could not remove %s: %s", self._path(address).name, exc.strerror or exc)

    def _warn_full(self, message: str) -> None:
        if not self._warned_full:
            logger.warning("prefix cache: %s; pages that do not fit are not written to disk", message)
            self._warned_full = True
