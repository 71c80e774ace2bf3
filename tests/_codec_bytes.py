"""Crafting and taking apart stored records byte by byte (kvckpt.storage.codec's framing)."""

from __future__ import annotations

import json
import struct
import zlib

import zstandard

from kvckpt.storage.codec import MAGIC


def seal(header: dict | bytes, body: bytes = b"", *, hlen: int | None = None) -> bytes:
    """A record with a *valid* checksum around an arbitrary header and body (a crafted value)."""
    hbytes = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    tail = struct.pack("<I", len(hbytes) if hlen is None else hlen) + hbytes + body
    return MAGIC + struct.pack("<I", zlib.crc32(tail)) + tail


def header_of(value: bytes) -> dict:
    (hlen,) = struct.unpack_from("<I", value, 8)
    return json.loads(value[12:12 + hlen])


def body_of(value: bytes) -> bytes:
    (hlen,) = struct.unpack_from("<I", value, 8)
    body = value[12 + hlen:]
    return zstandard.ZstdDecompressor().decompress(body) if header_of(value)["z"] else body
