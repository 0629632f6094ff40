"""Byte sizes, rates, durations and addresses as people write them: ``2GiB``, ``512MiB``, ``4M``,
``65536``; ``1GB/s``; ``30s``; ``HOST:PORT``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a number with an optional unit (K/M/G/T are binary; KB/MB/GB decimal).

    Raises:
        ValueError: not a size.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write for example 2GiB, 512MiB or 65536")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


#: Bits per second of a link, by unit (decimal, as links are sold): ``1gbit`` is 10**9 bit/s.
_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
              "bps": 1, "kbps": 10**3, "mbps": 10**6, "gbps": 10**9, "tbps": 10**12}


def parse_rate(text: str | float) -> float:
    """Bytes per second in ``text``: ``1gbit``, ``10Gbit/s``, ``100mbps`` (bits per second, decimal,
    divided by 8), or ``125MB/s``, ``1GiB/s``, ``125e6`` (bytes per second: a unit of :func:`parse_size`
    followed by ``/s``, so that ``1gb`` is refused rather than read as a gigabyte when a gigabit was meant).

    Raises:
        ValueError: not a rate, or not above zero.
    """
    if isinstance(text, int | float):
        rate = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([a-zA-Z]*)(/s)?\s*", text, re.IGNORECASE)
        unit = m.group(2).lower() if m else ""
        if m and unit in _BIT_UNITS:
            rate = float(m.group(1)) * _BIT_UNITS[unit] / 8
        elif m and unit in _UNITS and (m.group(3) or not unit):  # bytes need "/s": is "1gb" a gigabit?
            rate = float(m.group(1)) * _UNITS[unit]
        else:
            raise ValueError(f"{text!r} is not a rate: write for example 1gbit, 10gbit or 125MB/s")
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"{text!r} is not a rate: it must be above zero and finite")
    return rate


_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str | float) -> float:
    """Seconds in ``text``: ``100us``, ``1ms``, ``0.5s``, ``2`` (seconds), ``0``.

    Raises:
        ValueError: not a duration, or negative.
    """
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([a-zµ]*)\s*", text, re.IGNORECASE)
        if not m or m.group(2).lower() not in _TIME_UNITS:
            raise ValueError(f"{text!r} is not a duration: write for example 100us, 1ms or 0.5s")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{text!r} is not a duration: it must be zero or more, and finite")
    return seconds


def format_rate(bytes_per_s: float) -> str:
    """``125e6`` -> ``'1 Gbit/s'`` (decimal bits per second, as links are sold)."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def format_duration(seconds: float) -> str:
    """``0.00012`` -> ``'120 µs'``, ``1.5`` -> ``'1.5 s'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return "0 s" if seconds == 0 else f"{seconds / 1e-9:.3g} ns"


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6).

    Raises:
        ValueError: not of that form, or the port is not in 0..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {address!r} is not HOST:PORT (for example 127.0.0.1:7700)")
    return host.strip("[]"), int(port)


def format_host(address: str) -> str:
    """``HOST:PORT`` with an IPv6 host in brackets, for a URL."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
