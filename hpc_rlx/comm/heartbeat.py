"""The stall watchdog's datagrams: sealing, checking and decoding. Pure code, no sockets.

The side channel is a UDP port that anyone on the network can send to, so rank 0 acts on a
datagram only once it has passed every check here. Layout of one datagram:

    magic (2) | rank (4) | counter (8) | JSON payload | HMAC-SHA256 (32)

- the MAC covers the job nonce, the header and the payload, under a per-job key that rank 0
  draws with `secrets` and sends to the ranks over MPI (never over the side channel);
- `counter` counts datagrams per sender and only ever grows, so a captured datagram sent again
  is a replay (the watchdog's `seq` counts collectives and repeats across heartbeats);
- the rank travels in the header, so the sender's address can be checked before any
  cryptography, and the payload is decoded only after the MAC holds.

`HeartbeatGate.admit` returns the decoded heartbeat or the reason it was dropped; the caller
counts reasons and never prints per datagram, so a flood cannot fill the log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import struct

__all__ = ["MAX_DATAGRAM", "DROP_REASONS", "JobSecret", "HeartbeatSealer", "HeartbeatGate",
           "validate_heartbeat"]

MAGIC = b"\xb7\x01"
_HEADER = struct.Struct(">2sIQ")
_MAC_LEN = 32
MAX_DATAGRAM = 1024                  # a heartbeat is ~200 bytes; anything longer is refused
_MAX_LABEL = 96
_MAX_STEP = 2 ** 53
_MAX_SECONDS = 1e8                   # ~3 years: longer than any allocation

DROP_REASONS = ("oversized", "malformed", "foreign_sender", "bad_mac", "replay")


class JobSecret:
    """The per-job key and nonce. Drawn on rank 0, shipped to the ranks over MPI."""

    __slots__ = ("key", "nonce")

    def __init__(self, key: bytes, nonce: bytes):
        if len(key) < 16 or len(nonce) < 8:
            raise ValueError("heartbeat key or nonce too short")
        self.key, self.nonce = bytes(key), bytes(nonce)

    @classmethod
    def draw(cls) -> "JobSecret":
        return cls(secrets.token_bytes(32), secrets.token_bytes(16))

    def as_tuple(self) -> tuple[bytes, bytes]:
        return self.key, self.nonce


def _mac(secret: JobSecret, signed: bytes) -> bytes:
    return hmac.new(secret.key, secret.nonce + signed, hashlib.sha256).digest()


class HeartbeatSealer:
    """One rank's sending side: a new counter value and a MAC on every datagram."""

    def __init__(self, secret: JobSecret, rank: int):
        self.secret, self.rank = secret, int(rank)
        self.counter = 0

    def seal(self, msg: dict) -> bytes:
        self.counter += 1
        payload = json.dumps(msg, separators=(",", ":")).encode()
        signed = _HEADER.pack(MAGIC, self.rank, self.counter) + payload
        return signed + _mac(self.secret, signed)


class HeartbeatGate:
    """Rank 0's receiving side. `expected_sources[rank]` is the address that rank's datagrams
    come from (None: not known, not checked). Keeps the last counter seen per rank."""

    def __init__(self, secret: JobSecret, size: int, expected_sources: dict | None = None,
                 own_rank: int | None = None, answers: bool = False):
        self.secret, self.size = secret, int(size)
        self.sources = {r: a for r, a in (expected_sources or {}).items() if a}
        # this gate's own rank never sends to itself: its datagrams coming back are reflections
        self.own_rank = own_rank
        self.answers = answers          # True: rank 0's answers are wanted, else heartbeats
        self._last_counter: dict[int, int] = {}

    def admit(self, data: bytes, sender: str | None) -> tuple[dict | None, str | None]:
        """(heartbeat, None) for a datagram to act on, else (None, reason in DROP_REASONS)."""
        if len(data) > MAX_DATAGRAM:
            return None, "oversized"
        if len(data) < _HEADER.size + _MAC_LEN + 2:
            return None, "malformed"
        magic, rank, counter = _HEADER.unpack_from(data)
        if magic != MAGIC or rank >= self.size:
            return None, "malformed"
        if rank == self.own_rank:
            return None, "replay"
        expected = self.sources.get(rank)
        if expected is not None and sender != expected:
            return None, "foreign_sender"
        signed, mac = data[:-_MAC_LEN], data[-_MAC_LEN:]
        if not hmac.compare_digest(mac, _mac(self.secret, signed)):
            return None, "bad_mac"
        if counter <= self._last_counter.get(rank, 0):
            return None, "replay"
        try:
            msg = json.loads(signed[_HEADER.size:].decode())
        except (UnicodeDecodeError, ValueError):
            return None, "malformed"
        msg = validate_heartbeat(msg, rank)
        if msg is None or ("ack" in msg) != self.answers:
            return None, "malformed"
        self._last_counter[rank] = counter
        return msg, None


def _is_int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_seconds(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0.0 <= v <= _MAX_SECONDS


def _is_label(v) -> bool:
    return type(v) is str and 0 < len(v) <= _MAX_LABEL and v.isprintable()


def _is_step(v) -> bool:
    return v is None or _is_int(v, 0, _MAX_STEP)


def validate_heartbeat(msg, rank: int) -> dict | None:
    """The heartbeat with exactly the known fields, each of the right type and range, or None.
    `rank` is the header's rank, which the payload must repeat."""
    if type(msg) is not dict or msg.get("r") != rank or type(msg.get("r")) is not int:
        return None
    if "bye" in msg:
        return {"r": rank, "bye": msg["bye"]} if _is_label(msg["bye"]) else None
    if "ack" in msg:      # rank 0's answer to a heartbeat: "I hear you"
        return {"r": rank, "ack": msg["ack"]} if _is_int(msg["ack"], 0, _MAX_STEP) else None
    label, last = msg.get("label"), msg.get("last")
    ok = ((label is None or _is_label(label)) and _is_step(msg.get("step")) and _is_step(msg.get("at"))
          and _is_seconds(msg.get("for")) and _is_int(msg.get("seq"), 0, _MAX_STEP)
          and (last is None or (type(last) is list and len(last) == 2 and _is_label(last[0])
                                and _is_step(last[1]))))
    if not ok:
        return None
    out = {"r": rank, "label": label, "step": msg.get("step"), "for": float(msg["for"]),
           "seq": msg["seq"], "last": last}
    if label is None:
        out["at"] = msg.get("at")
    return out
