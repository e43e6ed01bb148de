"""JSON Schema keywords llguidance does not take, rewritten into ones it does, exactly,
or handed to the host as value checks (`Watch`), so that more schemas as people write
them are served and every answer still validates against the schema as written.

Rewritten into equivalent schemas (no answer gained or lost):
- `oneOf` whose branches no value can match twice (told apart by their types, or by a
  required property's `const`/`enum`, through local `$ref`s) -> `anyOf`;
- `oneOf` of `required` lists on an object ("exactly one of these keys") -> `anyOf` of
  each list with the others' keys absent;
- `dependentRequired` / `dependentSchemas` (and draft-07's `dependencies`) -> `allOf` of
  `anyOf: [key absent, key present and its dependency]`;
- `if` on one property's `const`/`enum` whose own schema is a finite `enum` ->
  `anyOf: [if and then, the property holding one of the other values and else]`.

Checked by the host (`Watch`, enforced by `pipeline/structured/json_watch.py` on each token):
- `uniqueItems` on arrays of strings, and `not` of an `enum`/`const` of strings on a
  string: a token that would complete a string equal to an earlier item (or to a
  forbidden value) is masked. Only where the string can always grow instead (no
  `maxLength`, `pattern`, `enum` or fixed-length `format`), so a mask never empties.

Closed on request (`close_objects`, the doors' default: docs/serving.md): an object that
lists its properties takes those only, where JSON Schema would take any other key too.

Anything else stays for llguidance to take or refuse in one line naming the keyword.
Only local `$ref`s ("#...") are followed; others are left for llguidance to refuse.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from qwen3_spmd.pipeline.requests import RequestError

TYPES = frozenset({"null", "boolean", "object", "array", "string", "number"})
# String formats whose values can always take one more character (so a watched string
# never has only a forbidden way to end): llguidance's email, uri and hostname.
GROWING_FORMATS = frozenset({"email", "uri", "uri-reference", "hostname"})
# Keys whose values are schemas: maps of them, lists of them, one of them.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_ONE = (
    "additionalProperties",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
# Keys that say nothing about which values a schema admits.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly"}
    | {"writeOnly"}
)


class SchemaError(RequestError):
    """A schema keyword used in a form this rewrite cannot serve (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Watch:
    """A check on the string values at `path` that the grammar cannot make.

    path: steps from the answer's root to the checked value: ("key", name), ("anykey",)
      (any member), ("index", i) or ("item",) (any array item).
    kind: "unique" (the value is an array: its string items differ from each other) or
      "not" (the value, a string, is none of `values`)."""

    path: tuple[tuple, ...]
    kind: str
    values: frozenset[str] = frozenset()


def rewrite(schema) -> tuple[object, tuple[Watch, ...]]:
    """`schema` (parsed JSON) -> (a schema llguidance may take, the host's checks).
    SchemaError for a keyword this cannot serve in the form used."""
    if not isinstance(schema, dict):
        return schema, ()
    root = _Rewriter(schema).schema(copy.deepcopy(schema))
    if not _has_watched(root, root, set()):
        return root, ()
    return root, _Watches(root).collect()


# Keywords beside `properties` that may admit keys it does not list: an object that has
# one stays as written when objects are closed.
OPENING = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependencies",
)
# Keywords that name keys of an object: schemas applied to the same object beside one of
# them must not be closed to their own keys.
NAMING = ("properties", "patternProperties", "additionalProperties", "required")


def close_objects(schema):
    """`schema` (parsed JSON) with each object that lists its `properties` closed to them
    (`additionalProperties: false`), as vLLM's xgrammar does in strict mode: JSON Schema
    leaves such an object open, and a weak model then writes keys without end. Every
    answer still validates against `schema`, so some stay as written (through the local
    `$ref`s they follow): an object with an OPENING keyword; one applied to the same
    value beside others that may name more keys (a branch of an `allOf` of several, of
    an `anyOf`/`oneOf`/`allOf` beside NAMING keywords or a `$ref`, the target of a `$ref`
    with NAMING siblings, a `then`, `else` or `dependentSchemas` schema); and everything
    under a `not` or an `if`, where a narrower schema would admit more."""
    if not isinstance(schema, dict):
        return schema
    root = copy.deepcopy(schema)
    kept: set[int] = set()  # ids of the schema objects that stay open
    frozen: set[int] = set()  # ids of those under a `not` or an `if`: nothing changes there
    for node in _subschemas(root):
        beside = any(key in node for key in (*NAMING, "$ref"))
        for key in SCHEMA_LISTS[:3]:  # allOf, anyOf, oneOf
            branches = node.get(key)
            if isinstance(branches, list) and (beside or (key == "allOf" and len(branches) > 1)):
                for branch in branches:
                    _through_refs(root, branch, kept)
        if "$ref" in node and any(key in node for key in NAMING):
            _through_refs(root, node, kept)
        for key in ("then", "else"):
            _through_refs(root, node.get(key), kept)
        if isinstance(node.get("dependentSchemas"), dict):
            for sub in node["dependentSchemas"].values():
                _through_refs(root, sub, kept)
        for key in ("not", "if"):
            _freeze(root, node.get(key), frozen)
    for node in list(_subschemas(root)):
        if (
            isinstance(node.get("properties"), dict)
            and id(node) not in kept | frozen
            and not any(key in node for key in OPENING)
        ):
            node["additionalProperties"] = False
    return root


def _through_refs(root, node, ids: set[int]) -> None:
    """Adds `node` and the schemas its chain of local `$ref`s names to `ids`."""
    refs = set()
    while isinstance(node, dict) and id(node) not in ids:
        ids.add(id(node))
        ref = node.get("$ref")
        if not isinstance(ref, str) or ref in refs:
            return
        refs.add(ref)
        node = _pointer(root, ref)


def _freeze(root, node, ids: set[int]) -> None:
    """Adds every schema object under `node`, and under the local `$ref`s met there, to
    `ids`."""
    todo = [node]
    while todo:
        for sub in _subschemas(todo.pop()):
            if id(sub) in ids:
                continue
            ids.add(id(sub))
            target = _pointer(root, sub.get("$ref"))
            if target is not None:
                todo.append(target)


def _subschemas(node):
    """Every schema object in `node`, itself first (depth first)."""
    if not isinstance(node, dict):
        return
    yield node
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                yield from _subschemas(sub)
    for key in (*SCHEMA_LISTS, *SCHEMA_ONE, "items"):
        subs = node.get(key)
        for sub in subs if isinstance(subs, list) else [subs]:
            yield from _subschemas(sub)


def _pointer(root, ref: str):
    """The schema a local `$ref` names (None: not local, or not found)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _resolve(root, node, seen=()):
    """`node` with its local `$ref`s followed against `root` (a `$ref` with siblings: both
    apply, so the siblings are kept beside the target's keys in an allOf); None for a
    `$ref` that is not local, not found, or met again."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        target = _pointer(root, ref)
        if target is None or ref in seen:
            return None
        seen = (*seen, ref)
        rest = {k: v for k, v in node.items() if k != "$ref"}
        node = target if not rest else {"allOf": [target, rest]}
    return node


def _value_key(value) -> str:
    """A value's identity as JSON Schema compares them (1 == 1.0; True is not 1)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    return json.dumps(value, sort_keys=True)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


class _Rewriter:
    """Rewrites every schema object of a schema (its `$defs` too), bottom up."""

    def __init__(self, original):
        self.original = original  # `$ref`s resolve against the schema as written

    def schema(self, node):
        if not isinstance(node, dict):
            return node
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {k: self.schema(v) for k, v in node[key].items()}
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [self.schema(v) for v in node[key]]
        for key in (*SCHEMA_ONE, "items"):
            if isinstance(node.get(key), dict):
                node[key] = self.schema(node[key])
            elif key == "items" and isinstance(node.get(key), list):
                node[key] = [self.schema(v) for v in node[key]]
        if node.get("uniqueItems") is False:
            del node["uniqueItems"]  # the default
        self._dependencies(node)
        self._if_then_else(node)
        self._one_of(node)
        return node

    def _resolve(self, node, seen=()):
        return _resolve(self.original, node, seen)

    def types(self, node, seen=()) -> frozenset[str]:
        """The JSON types some value matching `node` may have (a superset)."""
        if node is True or node == {}:
            return TYPES
        if node is False:
            return frozenset()
        if not isinstance(node, dict):
            return TYPES
        if "$ref" in node:
            ref = node["$ref"]
            if ref in seen:
                return TYPES
            target = self._resolve(node, seen)
            return TYPES if target is None else self.types(target, (*seen, ref))
        found = set(TYPES)
        if "type" in node:
            named = node["type"] if isinstance(node["type"], list) else [node["type"]]
            found &= {"number" if t == "integer" else t for t in named}
        if "const" in node:
            found &= {_json_type(node["const"])}
        if isinstance(node.get("enum"), list):
            found &= {_json_type(v) for v in node["enum"]}
        for sub in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            found &= self.types(sub, seen)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                found &= set().union(*(self.types(sub, seen) for sub in node[key]))
        return frozenset(found)

    def _values(self, node, name) -> tuple[frozenset | None, bool]:
        """(the values property `name` may take in `node`, None: not a finite set;
        whether `node` requires it)."""
        node = self._resolve(node)
        if not isinstance(node, dict):
            return None, False
        required = name in node.get("required", [])
        prop = self._resolve(node.get("properties", {}).get(name))
        if prop is False:
            return frozenset(), required
        if isinstance(prop, dict) and "const" in prop:
            return frozenset({_value_key(prop["const"])}), required
        if isinstance(prop, dict) and isinstance(prop.get("enum"), list):
            return frozenset(map(_value_key, prop["enum"])), required
        return None, required

    def disjoint(self, a, b) -> bool:
        """No value matches both `a` and `b` (False: not shown)."""
        shared = self.types(a) & self.types(b)
        if not shared:
            return True
        if shared != {"object"}:
            return False  # `required` and `properties` hold only for objects
        ra, rb = self._resolve(a), self._resolve(b)
        if not (isinstance(ra, dict) and isinstance(rb, dict)):
            return False
        names = set(ra.get("properties", {})) | set(rb.get("properties", {}))
        for name in names:
            va, need_a = self._values(ra, name)
            vb, need_b = self._values(rb, name)
            # a value held to a finite set where it must be present, and the other
            # branch's finite set for it apart from that one
            if va is not None and vb is not None and not va & vb and (need_a or need_b):
                return True
        return False

    def _one_of(self, node) -> None:
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            return
        if all(self.disjoint(a, b) for i, a in enumerate(branches) for b in branches[i + 1 :]):
            node["allOf"] = [*node.get("allOf", []), {"anyOf": node.pop("oneOf")}]
            return
        keys = [_only_required(b) for b in branches]
        if None in keys or not _is_object(node):
            return  # left for llguidance to refuse in its words
        exact = []
        for i, need in enumerate(keys):
            others = [set(other) - set(need) for j, other in enumerate(keys) if j != i]
            if any(not rest for rest in others):
                continue  # every answer with these keys has another branch's: none
            absent = [
                {"anyOf": [{"properties": {k: False}} for k in sorted(rest)]} for rest in others
            ]
            exact.append({"allOf": [{"required": list(need)}, *absent]})
        del node["oneOf"]
        node["allOf"] = [*node.get("allOf", []), {"anyOf": exact or [False]}]

    def _dependencies(self, node) -> None:
        """dependentRequired, dependentSchemas and draft-07's dependencies -> allOf."""
        needs = []
        for key in ("dependentRequired", "dependentSchemas", "dependencies"):
            entries = node.get(key)
            if not isinstance(entries, dict):
                continue
            for name, then in node.pop(key).items():
                present = (
                    {"required": [name, *then]}
                    if isinstance(then, list)
                    else {"allOf": [{"required": [name]}, then]}
                )
                needs.append({"anyOf": [{"properties": {name: False}}, present]})
        if needs:
            node["allOf"] = [*node.get("allOf", []), *needs]

    def _if_then_else(self, node) -> None:
        """`if` naming one property's const/enum, that property's schema a finite enum:
        anyOf [if + then, other values + else]. Other forms are left (and refused)."""
        test = node.get("if")
        if not isinstance(test, dict) or set(test) - {"properties"} - ANNOTATIONS:
            return
        props = test.get("properties", {})
        if len(props) != 1:
            return
        [(name, cond)] = props.items()
        if not isinstance(cond, dict) or set(cond) - {"const", "enum", "type"} - ANNOTATIONS:
            return
        held, _ = self._values({"properties": {name: cond}}, name)
        domain, _ = self._values(node, name)
        if held is None or domain is None:
            return
        own = self._resolve(node["properties"][name])
        others = [v for v in _domain_list(own) if _value_key(v) not in held]
        then, otherwise = node.get("then", True), node.get("else", True)
        branches = [{"allOf": [{"properties": {name: cond}}, then]}]
        if others:
            other = {"required": [name], "properties": {name: {"enum": others}}}
            branches.append({"allOf": [other, otherwise]})
        for key in ("if", "then", "else"):
            node.pop(key, None)
        node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]


def _domain_list(schema) -> list:
    return [schema["const"]] if "const" in schema else list(schema["enum"])


def _only_required(branch):
    """A oneOf branch that only lists required keys: its keys (None: it says more)."""
    if not isinstance(branch, dict) or set(branch) - {"required"} - ANNOTATIONS:
        return None
    need = branch.get("required")
    return tuple(need) if isinstance(need, list) and need else None


def _is_object(node) -> bool:
    named = node.get("type")
    return named == "object" or named == ["object"]


class _Watches:
    """The host's checks of a rewritten schema: where its `uniqueItems` and `not` apply."""

    def __init__(self, root):
        self.root = root
        self.found: list[Watch] = []

    def collect(self) -> tuple[Watch, ...]:
        """The checks; their keywords are then taken out of the schema (in place)."""
        self.checked: list[dict] = []
        self._walk(self.root, (), ())
        for node in self.checked:
            node.pop("uniqueItems", None)
            node.pop("not", None)
        return tuple(dict.fromkeys(self.found))

    def _walk(self, node, path, refs) -> None:
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            ref = node["$ref"]
            target = _pointer(self.root, ref)
            if target is not None:
                if ref in refs:
                    if _has_watched(target, self.root, set()):
                        raise SchemaError(
                            f"uniqueItems and not are taken only outside a recursive $ref ({ref})"
                        )
                else:
                    self._walk(target, path, (*refs, ref))
        if node.get("uniqueItems") is True:
            self._string_items(node, path)
            self.found.append(Watch(path, "unique"))
            self.checked.append(node)
        if "not" in node:
            self.found.append(Watch(path, "not", self._forbidden(node)))
            self.checked.append(node)
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []) if isinstance(node.get(key), list) else []:
                self._walk(sub, path, refs)
        for name, sub in (node.get("properties") or {}).items():
            self._walk(sub, (*path, ("key", name)), refs)
        for sub in (node.get("patternProperties") or {}).values():
            self._walk(sub, (*path, ("anykey",)), refs)
        self._walk(node.get("additionalProperties"), (*path, ("anykey",)), refs)
        items = node.get("items")
        for i, sub in enumerate(
            node.get("prefixItems") or (items if isinstance(items, list) else [])
        ):
            self._walk(sub, (*path, ("index", i)), refs)
        if isinstance(items, dict):
            self._walk(items, (*path, ("item",)), refs)

    def _string_items(self, node, path) -> None:
        items = node.get("items")
        if isinstance(items, dict):  # annotations beside a $ref say nothing of the values
            items = _resolve(self.root, {k: v for k, v in items.items() if k not in ANNOTATIONS})
        if not _growing_string(items) or node.get("prefixItems") or "contains" in node:
            raise SchemaError(
                "uniqueItems is taken on arrays whose items are strings without maxLength, "
                "pattern, enum or a fixed-length format (at "
                f"{_where(path)})"
            )

    def _forbidden(self, node) -> frozenset[str]:
        banned = node["not"]
        values = (
            [banned["const"]]
            if isinstance(banned, dict) and set(banned) == {"const"}
            else banned.get("enum")
            if isinstance(banned, dict) and set(banned) == {"enum"}
            else None
        )
        plain = {k: v for k, v in node.items() if k != "not"}
        if not isinstance(values, list) or not _growing_string(plain):
            raise SchemaError(
                "not is taken only as not {enum: [...]} or not {const: ...} on a string "
                "without maxLength, pattern or a fixed-length format"
            )
        return frozenset(v for v in values if isinstance(v, str))


def _growing_string(schema) -> bool:
    """A string schema whose every value can take one more character and stay valid."""
    if not isinstance(schema, dict) or schema.get("type") not in ("string", ["string"]):
        return False
    if {"maxLength", "pattern", "enum", "const", "not"} & set(schema):
        return False
    return schema.get("format") in (None, *GROWING_FORMATS)


def _has_watched(node, root, seen) -> bool:
    """Whether a `uniqueItems` or `not` lies in `node` (following local refs once)."""
    if isinstance(node, list):
        return any(_has_watched(v, root, seen) for v in node)
    if not isinstance(node, dict):
        return False
    if node.get("uniqueItems") is True or "not" in node:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref not in seen:
        seen.add(ref)
        if _has_watched(_pointer(root, ref), root, seen):
            return True
    return any(_has_watched(v, root, seen) for k, v in node.items() if k not in ("enum", "const"))


def _where(path) -> str:
    steps = [s[1] if s[0] == "key" else "*" if s[0] == "anykey" else "[]" for s in path]
    return "/".join(map(str, steps)) or "the root"
