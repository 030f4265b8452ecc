"""The options of each fit method, as schemas of the OpenAPI document.

Derived from the calibrators' own signatures (:data:`calibrators.CALIBRATORS`: each
``__init__``'s keyword options, their types and defaults, and the ranges of the
integer ones from ``option_checks``), never copied: a method or option added to the
library appears here. They document ``FitRequest.options``
(one object per method; for ``auto``, an object keyed by method), so a generated
client has typed options per method. The values are still checked by the library
when a fit is submitted (:func:`service.jobs.fitting.check_fit_request`: an unknown
option or a bad value is a 422 that names the valid ones).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

import calibrators
from calibrators.options import Integer
from service.vocabulary import AUTO


def _field(hint: Any, default: Any, check: Any) -> tuple[Any, Any]:
    if isinstance(default, tuple):  # a grid: a list of numbers on the wire
        return list[float], Field(list(default))
    if isinstance(check, Integer):  # its range, as the library checks it
        return hint, Field(default, ge=check.minimum, le=check.maximum)
    return hint, Field(default)


def _options_model(method: str, cls: type) -> type[BaseModel]:
    signature = inspect.signature(cls.__init__)
    hints = typing.get_type_hints(cls.__init__)
    fields = {
        name: _field(hints.get(name, Any), p.default, cls.option_checks.get(name))
        for name, p in signature.parameters.items()
        if name != "self" and p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    name = "".join(part.capitalize() for part in method.split("_")) + "Options"
    return create_model(
        name,
        __config__=ConfigDict(extra="forbid", title=name),
        __doc__=f"Options of a {method!r} fit (calibrators.create({method!r}, ...)).",
        **fields,
    )


#: Method -> the model of its options.
OPTION_MODELS: dict[str, type[BaseModel]] = {
    method: _options_model(method, cls) for method, cls in calibrators.CALIBRATORS.items()
}

AutoOptions = create_model(
    "AutoOptions",
    __config__=ConfigDict(extra="forbid", title="AutoOptions"),
    __doc__="Options of an 'auto' fit: per candidate method, its options.",
    **{method: (model | None, None) for method, model in OPTION_MODELS.items()},
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


#: The JSON schema of ``FitRequest.options``: one of the methods' option objects.
OPTIONS_SCHEMA: dict[str, Any] = {
    "description": "Keyword options of calibrators.create(method, ...): the object of "
    f"the fit's method; for {AUTO!r}, keyed by method.",
    "anyOf": [_ref(m.__name__) for m in (*OPTION_MODELS.values(), AutoOptions)],
}


def components() -> dict[str, dict[str, Any]]:
    """The option schemas, for the document's ``components.schemas``."""
    out: dict[str, dict[str, Any]] = {}
    for model in (*OPTION_MODELS.values(), AutoOptions):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out
