"""The schema rewrites of `pipeline/structured/schema_rewrite.py` admit exactly the values the schema
as written admits (checked with jsonschema on thousands of random values built from the
schema's own names and constants), and the host's checks (`pipeline/structured/json_watch.py`)
keep a token-by-token answer from repeating an array's string or writing a forbidden
one, where the grammar alone would.
"""

import json
import random

import jsonschema
import numpy as np
import pytest

from qwen3_spmd.pipeline.structured import schema_rewrite
from qwen3_spmd.pipeline.structured.constraints import Constraint, ConstraintError, Grammars
from qwen3_spmd.pipeline.structured.schema_rewrite import SchemaError, Watch, rewrite
from qwen3_spmd.run import qwen_tokenizer
from qwen3_spmd.run.text import Text

DEFS = {"label": {"type": "object", "properties": {"name": {"type": "string"}}}}
FILESYSTEM = {
    "$defs": {
        "file": {
            "type": "object",
            "properties": {"kind": {"const": "file"}, "size": {"type": "integer"}},
            "required": ["kind", "size"],
        },
        "dir": {
            "type": "object",
            "properties": {"kind": {"const": "dir"}, "entries": {"type": "array"}},
            "required": ["kind"],
        },
        "entry": {"oneOf": [{"$ref": "#/$defs/file"}, {"$ref": "#/$defs/dir"}]},
    },
    "$ref": "#/$defs/entry",
}
# (name, schema, extra values for the random pool): each rewritten exactly.
EXACT = [
    (
        "oneOf told apart by type through $ref",
        {
            "definitions": DEFS,
            "oneOf": [{"type": "string"}, {"$ref": "#/definitions/label"}, {"type": "null"}],
        },
        [],
    ),
    ("oneOf told apart by a required const, recursive", FILESYSTEM, ["file", "dir"]),
    (
        "oneOf of single required keys",
        {
            "type": "object",
            "properties": {"uses": {"type": "string"}, "run": {"type": "string"}},
            "oneOf": [{"required": ["uses"]}, {"required": ["run"]}],
        },
        [],
    ),
    (
        "oneOf of overlapping required lists",
        {
            "type": "object",
            "oneOf": [{"required": ["a", "b"]}, {"required": ["b", "c"]}, {"required": ["d"]}],
        },
        [],
    ),
    (
        "oneOf where one list holds another",
        {
            "type": "object",
            "oneOf": [{"required": ["a"]}, {"required": ["a", "b"]}],
        },
        [],
    ),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"box": {"type": "string"}, "street": {"type": "string"}},
            "dependentRequired": {"box": ["street"], "ext": ["street", "city"]},
        },
        [],
    ),
    (
        "dependentSchemas",
        {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "pct": {"type": "number"}},
            "required": ["on"],
            "dependentSchemas": {"pct": {"properties": {"on": {"const": True}}}},
        },
        [],
    ),
    (
        "draft-07 dependencies, both forms",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "dependencies": {"a": ["b"], "c": {"required": ["d"]}},
        },
        [],
    ),
    (
        "if/then/else on an enum",
        {
            "type": "object",
            "properties": {"country": {"enum": ["US", "CA", "MX"]}},
            "if": {"properties": {"country": {"const": "US"}}},
            "then": {"properties": {"zip": {"pattern": "^[0-9]{5}$"}}},
            "else": {"properties": {"zip": {"pattern": "^[A-Z][0-9][A-Z]$"}}},
        },
        ["US", "CA", "MX", "12345", "A1B"],
    ),
]


def _names_and_values(schema, names, values):
    if isinstance(schema, dict):
        for key, sub in schema.items():
            if key in ("properties", "dependentRequired", "dependentSchemas", "dependencies"):
                names.update(sub)
            if key == "required":
                names.update(sub)
            if key in ("dependentRequired", "dependencies"):
                names.update(n for v in sub.values() if isinstance(v, list) for n in v)
            if key == "const":
                values.append(sub)
            if key == "enum":
                values.extend(sub)
            _names_and_values(sub, names, values)
    elif isinstance(schema, list):
        for sub in schema:
            _names_and_values(sub, names, values)


def _random_value(rng, names, pool, depth):
    pick = rng.random()
    if depth == 0 or pick < 0.35:
        return rng.choice(pool)
    if pick < 0.5:
        return [_random_value(rng, names, pool, depth - 1) for _ in range(rng.randrange(3))]
    keys = [n for n in names if rng.random() < 0.5]
    return {k: _random_value(rng, names, pool, depth - 1) for k in keys}


@pytest.mark.parametrize("name,schema,extra", EXACT, ids=[c[0] for c in EXACT])
def test_a_rewrite_admits_exactly_what_the_schema_admits(name, schema, extra):
    rewritten, watches = rewrite(schema)
    assert not watches
    text = json.dumps(rewritten)
    assert not any(k in text for k in ('"oneOf"', "dependent", '"if"', '"dependencies"'))
    names, values = set(), []
    _names_and_values(schema, names, values)
    pool = [None, True, False, 0, 1, 2.5, "", "x", *values * 3, *extra * 3]
    cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    before, after = cls(schema), cls(rewritten)
    rng, told = random.Random(0), {True: 0, False: 0}
    for _ in range(4000):
        value = _random_value(rng, sorted(names), pool, depth=2)
        valid = before.is_valid(value)
        assert after.is_valid(value) == valid, (value, valid)
        told[valid] += 1
    assert min(told.values()) >= 40, told  # both answers met often enough to mean it


@pytest.mark.parametrize("name, schema, extra", EXACT, ids=[e[0] for e in EXACT])
def test_closing_objects_admits_only_what_the_schema_admits(name, schema, extra):
    """Over the same random values: every value the closed schema takes, the schema as
    written takes too, and the closed one still takes some."""
    names, values = set(), []
    _names_and_values(schema, names, values)
    pool = [None, True, False, 0, 1, 2.5, "", "x", *values * 3, *extra * 3]
    cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    written, closed = cls(schema), cls(schema_rewrite.close_objects(schema))
    rng, taken = random.Random(0), 0
    for _ in range(2000):
        value = _random_value(rng, sorted(names), pool, depth=2)
        if closed.is_valid(value):
            assert written.is_valid(value), value
            taken += 1
    assert taken >= 5


def test_an_overlapping_oneof_of_other_forms_is_left_for_the_engine_to_refuse():
    schema = {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]}
    assert rewrite(schema)[0]["oneOf"] == schema["oneOf"]
    untyped = {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}  # strings match both
    assert "oneOf" in rewrite(untyped)[0]


def test_watches_name_where_uniqueness_and_forbidden_values_apply():
    schema = {
        "$defs": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "type": "object",
        "properties": {
            "tags": {"$ref": "#/$defs/tags"},
            "user": {"type": "string", "minLength": 3, "not": {"enum": ["root", "admin"]}},
            "groups": {"type": "array", "items": {"$ref": "#/$defs/tags"}},
        },
        "additionalProperties": {"type": "string", "format": "email", "not": {"const": "a@b"}},
    }
    rewritten, watches = rewrite(schema)
    assert set(watches) == {
        Watch((("key", "tags"),), "unique"),
        Watch((("key", "user"),), "not", frozenset({"root", "admin"})),
        Watch((("key", "groups"), ("item",)), "unique"),
        Watch((("anykey",),), "not", frozenset({"a@b"})),
    }
    assert "uniqueItems" not in json.dumps(rewritten) and '"not"' not in json.dumps(rewritten)


@pytest.mark.parametrize(
    "schema,word",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}, "uniqueItems"),
        (
            {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True},
            "uniqueItems",
        ),
        ({"type": "string", "not": {"pattern": "^a"}}, "not"),
        ({"type": "string", "format": "date", "not": {"const": "2020-01-01"}}, "not"),
        (
            {
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {
                            "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}},
                            "tags": {
                                "type": "array",
                                "items": {"type": "string"},
                                "uniqueItems": True,
                            },
                        },
                    }
                },
                "$ref": "#/$defs/n",
            },
            "recursive",
        ),
    ],
)
def test_what_the_host_cannot_check_is_refused_naming_the_keyword(schema, word):
    with pytest.raises(SchemaError, match=word):
        rewrite(schema)


# --- the host's checks on Qwen3's tokenizer, token by token --------------------------


@pytest.fixture(scope="module")
def grammars():
    return Grammars.of_text(Text.qwen(), qwen_tokenizer.QWEN_VOCAB, qwen_tokenizer.EOS_IDS)


def _steer(grammars, row, target: str, steps: int = 80) -> tuple[str, bool]:
    """Drives `row` toward `target`'s text: each step the allowed token that writes the
    longest next piece of what is left of it, else `z` (which grows a string), else the
    lowest allowed id, and an end once the target is written. Returns the answer and
    whether it ended; asserts that the mask never empties."""
    texts, masks = grammars.texts.texts, grammars.masks(1)
    left, answer = target.encode(), b""
    grow = texts.index(b"z")
    for _ in range(steps):
        row.fill(masks, 0)
        allowed = np.flatnonzero(
            np.unpackbits(masks.view(np.uint8), bitorder="little")[: grammars.vocab]
        )
        assert allowed.size, f"nothing allowed after {answer!r}"
        ends = [t for t in qwen_tokenizer.EOS_IDS if t in set(allowed)]
        pieces = [t for t in allowed if texts[t] and left.startswith(texts[t])]
        token = (
            max(pieces, key=lambda t: len(texts[t]))
            if pieces
            else ends[0]
            if ends and not left
            else grow
            if grow in set(allowed)
            else int(allowed[0])
        )
        if pieces:
            left = left[len(texts[token]) :]
        answer += b"" if token in qwen_tokenizer.EOS_IDS else texts[token]
        if row.take(token):
            return answer.decode(), True
    return answer.decode(), False


STEERED = [
    (
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        '{"tags":["a","a","b","a","b",""]}',
    ),
    (
        {
            "type": "object",
            "properties": {
                "user": {"type": "string", "not": {"enum": ["root", "admin", ""]}},
                "mail": {
                    "type": "array",
                    "items": {"type": "string", "format": "email"},
                    "uniqueItems": True,
                    "maxItems": 3,
                },
            },
            "required": ["user", "mail"],
            "additionalProperties": False,
        },
        '{"user":"root","mail":["a@b.io","a@b.io","a@b.io"]}',
    ),
    (
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        '["x","x\\"","x\\"","x"]',  # an escaped quote in a repeat
    ),
]


@pytest.mark.parametrize("schema,target", STEERED, ids=["unique", "not, emails", "escapes"])
def test_the_host_steers_an_answer_off_repeats_and_forbidden_values(grammars, schema, target):
    """Steered toward an answer that breaks the schema, the row writes one that keeps
    it; without the host's checks (the grammar alone) it writes the broken one."""
    validator = jsonschema.Draft202012Validator(schema)
    assert not validator.is_valid(json.loads(target))
    constraint = Constraint.json_schema(schema)
    answer, ended = _steer(grammars, grammars.matcher(constraint), target)
    assert ended, answer
    validator.validate(json.loads(answer))
    bare = grammars.matcher(constraint)
    bare.watch = None
    assert json.loads(_steer(grammars, bare, target)[0]) == json.loads(target)


def test_a_refusal_reaches_the_caller_as_a_constraint_error(grammars):
    schema = {"type": "array", "items": {"type": "number"}, "uniqueItems": True}
    with pytest.raises(ConstraintError, match="uniqueItems"):
        grammars.compile(Constraint.json_schema(schema))
    assert schema_rewrite.GROWING_FORMATS  # the formats a watched string may have


# ---- closing objects (the doors' default) -----------------------------------------------


class _Extra:
    """Pydantic's schema of a model with a nested model (`$defs`), as LangChain sends it."""

    SCHEMA = {
        "$defs": {
            "Place": {
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "title": "Place",
                "type": "object",
            }
        },
        "properties": {"ok": {"type": "boolean"}, "where": {"$ref": "#/$defs/Place"}},
        "required": ["ok", "where"],
        "title": "Verdict",
        "type": "object",
    }


def test_closing_objects_refuses_other_keys_and_keeps_every_answer_valid():
    """Each object that lists its properties takes those only, nested ones and `$defs`
    too: an answer with another key validated before and is refused after; the answer
    with the listed keys validates both ways; the schema passed in is not changed."""
    schema = _Extra.SCHEMA
    closed = schema_rewrite.close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Place"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    good = {"ok": True, "where": {"city": "Oslo"}}
    for extra in ({**good, "x": 1}, {"ok": True, "where": {"city": "Oslo", "zip": "0150"}}):
        jsonschema.validate(extra, schema)
        with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
            jsonschema.validate(extra, closed)
    jsonschema.validate(good, closed)


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": {"a": {}}, "additionalProperties": True},
        {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]},
        {"type": "object"},  # lists nothing: any object (json_object)
    ],
    ids=["open", "typed extras", "patterns", "beside anyOf", "no properties"],
)
def test_an_object_that_admits_other_keys_stays_as_written(schema):
    assert schema_rewrite.close_objects(schema) == schema


def test_alternatives_close_and_what_a_narrower_schema_would_widen_stays():
    """The branches of a oneOf with nothing beside it are closed through their `$ref`s
    (each alone must match). A `not` stays as written (closing inside it would admit
    more), the object around it closed to its own properties; a dependentSchemas schema
    (applied beside the object's own keys) stays, and keeps its object open."""
    closed = schema_rewrite.close_objects(FILESYSTEM)
    for name in ("file", "dir"):
        assert closed["$defs"][name]["additionalProperties"] is False
    jsonschema.validate({"kind": "dir", "entries": []}, closed)
    negated = {"not": {"properties": {"b": {}}, "required": ["b"]}}
    schema = {"properties": {"a": {"type": "integer"}}, **negated}
    closed = schema_rewrite.close_objects(schema)
    assert closed == {**schema, "additionalProperties": False}
    dependent = {"properties": {"a": {}}, "dependentSchemas": {"a": {"properties": {"c": {}}}}}
    assert schema_rewrite.close_objects(dependent) == dependent


def test_the_branches_of_an_allof_stay_open_through_their_refs():
    """allOf [A, B] takes A's keys and B's: closing either would refuse the other's, so
    both stay open, A through its `$ref`; an object inside a branch is closed."""
    schema = {
        "$defs": {"A": {"properties": {"a": {"type": "integer"}, "in": {"properties": {"c": {}}}}}},
        "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "integer"}}}],
    }
    closed = schema_rewrite.close_objects(schema)
    assert "additionalProperties" not in closed["$defs"]["A"]
    assert "additionalProperties" not in closed["allOf"][1]
    assert closed["$defs"]["A"]["properties"]["in"]["additionalProperties"] is False
    jsonschema.validate({"a": 1, "b": 2}, closed)
