"""Units of the link: rates in bits per second as tc writes them, latencies with their unit. The one parser of
each, for ``osp.plan`` (the planner), ``osp.linkemu`` (the emulated link) and the benchmarks alike; it imports
nothing of osp, so any layer may use it."""
from __future__ import annotations

import math
import re

__all__ = ["parse_bandwidth", "parse_latency"]

# tc's rate units (tc(8), RATES): "bit" and a bare number are bits per second, "bps" is BYTES per second; IEC
# prefixes (kibit) are powers of 1024
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30,
           "ti": 2.0**40}
_RATE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:(k|m|g|t|ki|mi|gi|ti)?bits?(?:/s|ps)?)?")
_BYTES = re.compile(r"[0-9.e+-]+\s*(?:k|m|g|t|ki|mi|gi|ti)?(?:i?bps|b/s|bytes?(?:/s)?|b)")


def parse_bandwidth(text: str) -> float:
    """Bits per second of a link rate spelled in bits: ``1gbit``, ``400mbit``, ``25Gbit/s``, ``10kbit``, ``1gibit``
    (2^30), or a bare number of bits per second (tc's units, tc(8)). Byte spellings (``1GB/s``, ``125MBps``) and
    ``...bps`` (``1Gbps``: gigaBYTES per second to tc, gigabits to network marketing) are refused, not guessed."""
    raw = str(text)
    low = raw.strip().lower()
    m = _RATE.fullmatch(low)
    if not m:
        if _BYTES.fullmatch(low.replace(" ", "")):
            raise ValueError(f"got {raw!r}: write a link rate in bits per second with 'bit', as tc writes it "
                             "(1gbit, 400mbit, 25Gbit/s). 'bps', 'b/s' and 'B/s' are refused, not guessed: tc reads "
                             "'1gbps' as 1 gigaBYTE per second (8 Gbit/s), network specifications as 1 gigabit")
        raise ValueError(f"a link rate is a number of bits per second as tc writes it (1gbit, 400mbit, "
                         f"25Gbit/s, 10kbit), got {raw!r}")
    value = float(m.group(1)) * _PREFIX[m.group(2) or ""]
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"a link rate must be positive, got {raw!r}")
    return value


_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_latency(text) -> float:
    """A latency in seconds: ``200us``, ``0.5ms``, ``1ms``, ``50`` (a bare number is microseconds), ``0``."""
    t = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-zµ]*)", t)
    if m and (m.group(2) in _LATENCY_UNITS or m.group(2) == ""):
        return float(m.group(1)) * _LATENCY_UNITS.get(m.group(2), 1e-6)
    raise ValueError(f"latency must be a number >= 0 with a unit (us, ms, s; a bare number is microseconds), "
                     f"e.g. 200us or 50, got {text!r}")
