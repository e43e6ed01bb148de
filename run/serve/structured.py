"""Structured outputs as the API asks for them -> one `pipeline.structured.constraints.Constraint`.

A request may ask in one of these ways (two at once is a 400 naming both):

    response_format     {"type": "json_object"} | {"type": "json_schema", "json_schema":
                        {"name", "schema", "strict"}} | {"type": "text"} (OpenAI's)
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
                        (vLLM's extra field)
    guided_json, guided_regex, guided_choice, guided_grammar (vLLM's older fields)
    tool_choice         "required", or {"type": "function", "function": {"name": N}}:
                        a call in Qwen3's hermes format (`tools`), its arguments
                        following the tool's `parameters`

With tools and tool_choice "auto" (the default), an answer format leaves the model the
choice: the answer, or calls. A forced call wins over an answer format, which then has
no text to apply to (as in vLLM; the Agents SDK sends both for an agent with an
output_type whose tool use is required). Each error is a 400 that names the field at
fault.
"""

from __future__ import annotations

import json

from qwen3_spmd.pipeline.structured.constraints import JSON_OPTIONS, Constraint
from qwen3_spmd.pipeline.structured.schema_rewrite import close_objects
from qwen3_spmd.run.request_fields import constraint, one_format
from qwen3_spmd.run.serve.protocol import APIError
from qwen3_spmd.run.serve.tools import CLOSE, OPEN

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def constraint_of(
    body,
    read_tools: bool = False,
    after: int | None = None,
    tag_tokens: bool = False,
    closed: bool = True,
) -> tuple[Constraint | None, str | None]:
    """(the request's constraint, the field it came from), (None, None) when it asks for
    none. read_tools: the reply is read for tool calls (`tools.check_request`); after:
    the token id that starts the constraint (Qwen3's `</think>` with thinking on);
    tag_tokens: `<tool_call>` and `</tool_call>` are tokens of their own (added tokens,
    as in Qwen3's tokenizer), which the grammar names as such (llguidance never spells
    an added token with text); closed: the JSON Schemas' objects, a tool's parameters
    too, take only the properties they list (--structured-outputs-config)."""
    asked = [(field, kind, spec) for field, kind, spec in _answer_formats(body) if kind]
    if len(asked) > 1:
        names = " and ".join(field for field, _, _ in asked)
        raise APIError(400, f"{names} each ask for a format: send one", asked[1][0])
    choice = getattr(body, "tool_choice", None)
    forced = read_tools and (choice == "required" or isinstance(choice, dict))
    if forced:  # the reply is a call: an answer format has no text to apply to (vLLM's way)
        names = [choice["function"]["name"]] if isinstance(choice, dict) else None
        parallel = getattr(body, "parallel_tool_calls", None)
        calls = _calls(body.tools, names, parallel, tag_tokens, closed)
        return Constraint("grammar", f"start: calls\n{calls}", after), "tools"
    if not asked:
        return None, None
    field, kind, spec = asked[0]
    if kind == "json" and closed:
        spec = constraint(kind, spec).spec
    if read_tools and body.tools and choice in (None, "auto"):
        # The answer in its format, or calls: the model keeps the choice "auto" gives.
        answer = _as_lark(kind, spec, field)
        parallel = getattr(body, "parallel_tool_calls", None)
        calls = _calls(body.tools, None, parallel, tag_tokens, closed)
        grammar = f"start: answer | calls\nanswer: {answer}\n{calls}"
        return Constraint("grammar", grammar, after), field
    return Constraint(kind, spec, after), field


def _answer_formats(body) -> list[tuple[str, str | None, str | None]]:
    """(field, kind, spec) of every way the body asks for an answer format (kind None:
    the field is there and asks for none)."""
    out = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        out.append(_response_format(rf))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        key, kind, spec = _structured_outputs(so)
        out.append((f"structured_outputs.{key}", kind, spec))
    for field, kind in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            out.append((field, kind, _spec(kind, value, field)))
    return out


def _response_format(rf) -> tuple[str, str | None, str | None]:
    """(the field, the constraint's kind, its spec)."""
    if rf.type == "text":
        return "response_format", None, None
    if rf.type == "json_object":
        return "response_format", "json", constraint("json_object", True).spec
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(
            400,
            'response_format of type "json_schema" needs json_schema.schema',
            "response_format.json_schema.schema",
            "invalid_value",
        )
    field = "response_format.json_schema.schema"
    return field, "json", _spec("json", rf.json_schema.schema_, field)


def _structured_outputs(so) -> tuple[str, str, str]:
    """(the key given, the constraint's kind, its spec)."""
    if so.structural_tag is not None:
        raise APIError(
            400,
            "structured_outputs.structural_tag is not served: use json, regex, choice or grammar",
            "structured_outputs.structural_tag",
            "unsupported_value",
        )
    values = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
    try:
        name, value = one_format({**values, "json_object": so.json_object})
    except ValueError as e:
        raise APIError(
            400, f"structured_outputs {e}", "structured_outputs", "invalid_value"
        ) from None
    if name == "json_object":
        return name, "json", constraint(name, value).spec
    return name, name, _spec(name, value, f"structured_outputs.{name}")


def _spec(kind: str, value, field: str) -> str:
    """A constraint's spec text from the field's value, checked for its shape."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise APIError(400, f"{field}: not JSON ({e})", field, "invalid_value") from None
        if not isinstance(value, dict | bool):
            raise APIError(400, f"{field}: a JSON Schema is an object", field, "invalid_value")
        return constraint(kind, value, closed=False).spec  # closed by constraint_of
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise APIError(
                400, f"{field}: a choice is a non-empty list of strings", field, "invalid_value"
            )
        return constraint(kind, value).spec
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{field}: a non-empty string is needed", field, "invalid_value")
    return value


def _as_lark(kind: str, spec: str, field: str) -> str:
    """A constraint as one Lark expression (a rule's right side)."""
    if kind == "json":
        return f"%json {_compact_schema(json.loads(spec), field)}"
    if kind == "regex":
        return "/" + spec.replace("/", "\\/") + "/"
    if kind == "choice":
        return " | ".join(json.dumps(o) for o in json.loads(spec))
    raise APIError(
        400,
        f"{field}: a grammar cannot be combined with tools under tool_choice auto: send "
        'tool_choice "none", or a JSON Schema, regex or choice',
        field,
        "unsupported_value",
    )


def _compact_schema(schema, field: str = "tools") -> str:
    """A schema for Lark's %json, with the compact JSON options (Lark has no defaults)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise APIError(400, f"{field}: a JSON Schema is an object", field, "invalid_value")
    own = schema.get("x-guidance")
    guidance = {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
    return json.dumps({**schema, "x-guidance": guidance}, separators=(",", ":"))


def _calls(
    tools: list, names: list[str] | None, parallel: bool | None, tag_tokens: bool, closed: bool
) -> str:
    """Lark rules for Qwen3's hermes calls to `tools` (only those `names`), one or
    (parallel not False) several: `calls`. tag_tokens: the tags are the tokenizer's
    added tokens (Lark's `<name>`), else text; closed: the parameters' objects take only
    the properties they list."""
    options = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if names is not None and function["name"] not in names:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            field = f"tools.{i}.function.parameters"
            raise APIError(400, f"{field}: a JSON Schema is an object", field, "invalid_value")
        if closed:
            parameters = close_objects(parameters)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    one = options[0] if len(options) == 1 else {"anyOf": options}
    open_tag, close_tag = (OPEN, CLOSE) if tag_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    call = f'call: {open_tag} "\\n" %json {_compact_schema(one)} "\\n" {close_tag}'
    many = 'calls: call ("\\n" call)*' if parallel is not False else "calls: call"
    return f"{many}\n{call}\n"
