"""Human-readable numbers for the flops profiler (``1.23 G``, ``4.5 GMACs``, ``76.39 ms``).

Same helper names, unit letters and strings as DeepSpeed's flops profiler (thousands are ``K``:
``995.97 K``, ``488.7 KMACs``), so that scripts which format their own numbers with them, and
people reading the profile, see the same text (tests/data/deepspeed/flops_strings.json). Values
are rounded to ``precision`` decimals and printed with at most 6 significant digits, without
trailing zeros (``%g``, as DeepSpeed). One deliberate
difference: a number forced into a unit too small for it is printed in full (``1234567 ``),
never in exponent notation (DeepSpeed 0.19.8: ``1.23457e+06 ``), and a negative number rounded to
zero prints ``0`` (DeepSpeed: ``-0``). ``units="k"`` is taken as ``"K"``.
"""
from __future__ import annotations

from typing import Optional

#: unit letter -> scale, largest first ("" is the plain number)
UNITS = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}
DEFAULT_PRECISION = 2


def _plain(value: float, precision: int) -> str:
    """``value`` rounded to ``precision`` decimals, then at most 6 significant digits (DeepSpeed's
    ``%g``); a number that ``%g`` would write with an exponent is written in full instead."""
    rounded = round(value, precision)
    text = f"{rounded:g}"
    if "e" in text:
        text = f"{rounded:.{max(precision, 0)}f}"
        if "." in text:
            text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _scale_for(num: float, units: Optional[str]):
    if units is not None:
        key = "K" if units == "k" else units
        if key not in UNITS:
            valid = ", ".join(repr(u) for u in UNITS)
            raise ValueError(f"unknown units {units!r}: use one of {valid} (or None to pick one)")
        return key, UNITS[key]
    magnitude = abs(num)
    if magnitude == 0:
        return "", 1.0
    for unit, scale in UNITS.items():
        if magnitude >= scale:
            return unit, scale
    return "u", UNITS["u"]


def number_to_string(num, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """``1234567`` -> ``"1.23 M"``; ``units`` forces a unit letter (T, G, M, K, "", m, u)."""
    unit, scale = _scale_for(float(num), units)
    return f"{_plain(float(num) / scale, precision)} {unit}"


def macs_to_string(macs, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """``3.1e12`` -> ``"3.1 TMACs"``."""
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate: ``8.2e13`` -> ``"82 TFLOPS"``."""
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def bytes_to_string(num_bytes, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(num_bytes, units=units, precision=precision)}B"


def params_to_string(params_num, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameter counts say billions with ``B``: ``1.5e9`` -> ``"1.5 B"``, ``2`` -> ``"2"``."""
    if units == "B":
        units = "G"
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """Seconds: ``0.07639`` -> ``"76.39 ms"``."""
    return f"{number_to_string(duration, units=units, precision=precision)}s"


def percent(part, whole) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"
