"""The argument checks every module shares: one place for "is this an int", int64 bounds and
the messages that name what is wrong. Imports nothing of radixcache; every layer may use it."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

__all__ = ["INT64_MIN", "INT64_MAX", "is_int", "is_real", "in_int64", "wrap_int64", "check_int",
           "check_optional_int", "check_real", "counted"]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def is_int(value: Any) -> bool:
    """An integer that is not a bool: ``int``, numpy integers and other ``numbers.Integral``."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def is_real(value: Any) -> bool:
    """A real number that is not a bool (ints, floats, numpy scalars)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1: "1 token", "2,048 tokens"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def in_int64(value: int) -> bool:
    """Whether an int fits a signed 64-bit integer."""
    return INT64_MIN <= value <= INT64_MAX


def wrap_int64(value: int) -> int:
    """An int taken modulo 2**64: the signed 64-bit integer with the same low 64 bits (a
    64-bit hash spelled unsigned, ``k + 2**64``, is ``k``)."""
    if INT64_MIN <= value <= INT64_MAX:
        return value
    return ((value - INT64_MIN) & 0xFFFFFFFFFFFFFFFF) + INT64_MIN


def check_int(value: Any, what: str, low: Optional[int] = None,
              high: Optional[int] = None) -> int:
    """``value`` as a plain int, or the error a caller gets.

    Raises:
        TypeError: not an int ("{what} must be an int, got float").
        ValueError: below ``low`` or above ``high`` ("{what} must be >= 1, got 0").
    """
    if not is_int(value):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{what} must be <= {high}, got {value}")
    return value


def check_optional_int(value: Any, what: str, low: Optional[int] = None,
                       high: Optional[int] = None) -> Optional[int]:
    """``None``, or ``check_int``'s answer ("{what} must be an int or None, got str")."""
    if value is None:
        return None
    if not is_int(value):
        raise TypeError(f"{what} must be an int or None, got {type(value).__name__}")
    return check_int(value, what, low, high)


def check_real(value: Any, what: str, low: Optional[float] = None, *,
               low_inclusive: bool = True, finite: bool = True) -> float:
    """``value`` as a float, or the error a caller gets.

    Raises:
        TypeError: not a real number.
        ValueError: NaN, infinite (when ``finite``), or below ``low`` (or equal to it, when
            not ``low_inclusive``).
    """
    if not is_real(value):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{what} must be a finite number, got {value}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"{what} must be {bound} {low:g}, got {value:g}")
    return value
