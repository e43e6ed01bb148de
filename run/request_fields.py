"""A request's fields read one way for every door (generate, `LLM`, the server): the ids
that end it, and the constraint its structured-output fields ask for.

Each door checks its own spelling of the fields (flags, keyword arguments, JSON) and
says its errors its own way; what the fields then mean is decided here, once.
"""

from __future__ import annotations

import dataclasses
import json

from qwen3_spmd.pipeline.structured.constraints import Constraint
from qwen3_spmd.pipeline.structured.schema_rewrite import close_objects
from qwen3_spmd.run.flags import json_object

# Structured outputs' fields, vLLM's names: json (a JSON Schema, a dict or its text),
# regex, choice (a list of strings), grammar (Lark or GBNF), json_object (any JSON object).
FORMATS = ("json", "regex", "choice", "grammar", "json_object")


def end_ids(
    eos_ids: tuple[int, ...], stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False
) -> tuple[int, ...]:
    """The ids that end a request: the model's EOS ids (unless ignore_eos), then
    stop_token_ids, each once, in that order."""
    return tuple(dict.fromkeys((() if ignore_eos else tuple(eos_ids)) + tuple(stop_token_ids)))


def one_format(values: dict) -> tuple[str, object]:
    """(name, value) of the one structured-output field of `values` (name -> value, names
    of FORMATS) that is given: not None, and json_object not False. ValueError, its text
    the rule and the names given, unless exactly one is."""
    given = [
        name
        for name in FORMATS
        if values.get(name) is not None and not (name == "json_object" and values[name] is False)
    ]
    if len(given) != 1:
        raise ValueError(
            "takes exactly one of json, regex, choice, grammar or json_object "
            f"({', '.join(given) or 'none'} given)"
        )
    return given[0], values[given[0]]


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's structured_outputs_config, the key served here. disable_additional_properties:
    an object schema that lists its properties takes those only, unless it says otherwise
    (`schema_rewrite.close_objects`); True here, where vLLM's guidance backend defaults
    to False (its xgrammar backend closes them)."""

    disable_additional_properties: bool = True

    @classmethod
    def parse(cls, value: str | dict | None) -> StructuredOutputsConfig:
        """From JSON text or a mapping (None: the defaults); ValueError naming the fault."""
        if value is None:
            return cls()
        value = json_object(value)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a key served here (only {', '.join(known)})")
        closed = value.get("disable_additional_properties", True)
        if not isinstance(closed, bool):
            raise ValueError(f"disable_additional_properties {closed!r} must be true or false")
        return cls(closed)


def constraint(name: str, value, after: int | None = None, closed: bool = True) -> Constraint:
    """The engine's `Constraint` for structured-output field `name` (of FORMATS) holding
    `value`; after: the token id that starts it (None: the first token); closed: a JSON
    Schema's objects take only the properties they list (`StructuredOutputsConfig`)."""
    if name == "json_object":
        return Constraint.json_schema({"type": "object"}, after)
    if name == "json":
        if closed:
            try:
                value = close_objects(json.loads(value) if isinstance(value, str) else value)
            except ValueError:
                pass  # not JSON: the grammar engine refuses it, saying why
        return Constraint.json_schema(value, after)
    if name == "choice":
        return Constraint.choice(value, after)
    return Constraint(name, value, after)  # regex, grammar: the text as given
