"""Options of the calibrators: the check each option declares, and the one rule applying them.

A calibrator class declares ``option_checks`` (name -> check, in the order of its
``__init__`` signature); the checks are the callables of this module, each
``check(name, value) -> canonical value`` raising CalibrationInputError.
:meth:`calibrators.base.Calibrator.checked_options` applies them (a class with rules
across options extends it), and :func:`reject_unknown` refuses names a class does
not have: :func:`calibrators.create`, :func:`calibrators.check_options`, ``fit`` and
``to_params`` all go through these two and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from calibrators.validation import CalibrationInputError, check_integer, check_positive


def reject_unknown(method: str, known, options: Any) -> None:
    """Raise CalibrationInputError unless ``options`` is a mapping of names among ``known``.

    The message lists the valid names.
    """
    if not isinstance(options, Mapping):
        raise CalibrationInputError(
            f"options of {method} must be a mapping of option names to values. "
            f"Got {options!r}."
        )
    unknown = [name for name in options if name not in known]
    if unknown:
        raise CalibrationInputError(
            f"options of {method} must be among {', '.join(known)}. "
            f"Got unknown {', '.join(repr(name) for name in unknown)}."
        )


@dataclass(frozen=True)
class Integer:
    """Option check: an integer (never a bool) in ``[minimum, maximum]`` (None: no bound).

    Every integer option of the library's methods has both bounds (the ranges are
    in :mod:`calibrators.validation`: ``MAX_ITERATIONS``, ``MAX_FOLDS``, ...); the
    service's OpenAPI document shows them.
    """

    minimum: int | None = None
    maximum: int | None = None

    def __call__(self, name: str, value: Any) -> int:
        return check_integer(name, value, minimum=self.minimum, maximum=self.maximum)


@dataclass(frozen=True)
class Positive:
    """Option check: a finite number > 0 (or also 0, or also None)."""

    allow_zero: bool = False
    allow_none: bool = False

    def __call__(self, name: str, value: Any):
        return check_positive(name, value, allow_zero=self.allow_zero, allow_none=self.allow_none)


def check_grid(name: str, value) -> list[float]:
    """The penalty grid as a list of distinct floats, strongest (largest) first.

    Raises CalibrationInputError unless ``value`` is a non-empty list (or tuple,
    or 1-D array) of finite numbers > 0.
    """
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise CalibrationInputError(
            f"{name} must be a non-empty list of finite numbers > 0. Got {value!r}."
        )
    values = [check_positive(f"{name} values", g) for g in value]
    if not values:
        raise CalibrationInputError(
            f"{name} must be a non-empty list of finite numbers > 0. Got {value!r}."
        )
    return sorted({float(g) for g in values}, reverse=True)
