"""Argument checks shared by every public constructor: one wording for every error.

Each helper raises ``ValueError`` naming the argument (``Owner.field``), the bad value and what is
allowed, and returns the value unchanged, so a check reads ``check_int("LLM.seed", seed, minimum=0)``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

__all__ = ["check_bool", "check_choice", "check_float", "check_int", "check_optional_int", "check_text"]


def check_int(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``value`` must be an int (``bool`` refused) in ``[minimum, maximum]`` (either end optional)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_optional_int(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None):
    """``None`` or an int as in :func:`check_int`."""
    return None if value is None else check_int(name, value, minimum, maximum)


def check_float(
    name: str,
    value: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` must be a finite real number (int or float, ``bool`` refused) in the interval
    from ``low`` to ``high``; ``low_open``/``high_open`` exclude the ends. Returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in {left}{lo}, {hi}{right}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """``value`` must be one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` must be ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(name: str, value: str) -> str:
    """``value`` must be text that UTF-8 can encode: no lone surrogate (``"\\ud800"``, which JSON's ``\\u``
    escapes can spell and a tokenizer cannot encode). A ``str`` is assumed; returns it unchanged."""
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise ValueError(f"{name} is not valid Unicode: a lone surrogate {bad.group()!r} at character "
                         f"{bad.start()}; text must be encodable as UTF-8 (send a surrogate pair as one character)")
    return value
