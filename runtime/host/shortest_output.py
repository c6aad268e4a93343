"""A lower bound on the bytes any output matching a structured-output constraint has, so the
request door can refuse a constraint that cannot be completed within max_tokens: a token spells
at most the vocabulary's longest piece, so a match needs at least
ceil(shortest_bytes / longest_piece) tokens. Bounds are sound (never above the true shortest
match); what they cannot bound (a Lark grammar, `$ref`, a regex Python cannot parse) is 0.

JSON lengths follow the compact form the engine generates (runtime.host.structured.JSON_OPTIONS):
`", "` between items, `": "` after keys, no other whitespace.
"""

from __future__ import annotations

import json

_ITEM_SEP, _KEY_SEP = 2, 2  # len(", "), len(": ")
_MAX_DEPTH = 64


def shortest_bytes(so) -> int:
    """The fewest UTF-8 bytes of any text matching `so` (a StructuredOutputs), as a lower bound."""
    kind = so.kind
    if kind == "choice":
        return min(len(c.encode()) for c in so.choice)
    if kind == "json_object":
        return 2  # {}
    if kind == "json":
        return _json_min(json.loads(so.json), 0)
    if kind == "regex":
        return _regex_min(so.regex)
    return 0  # Lark: no bound


def _regex_min(pattern: str) -> int:
    """Python's parser's minimum width (characters, each >= 1 byte) of the regex."""
    try:
        import re._parser as sre  # Python >= 3.11
    except ImportError:  # pragma: no cover
        return 0
    try:
        return int(sre.parse(pattern).getwidth()[0])
    except Exception:  # noqa: BLE001 - llguidance's regex dialect is not Python's
        return 0


def _compact(v) -> int:
    return len(json.dumps(v, ensure_ascii=False, separators=(", ", ": ")).encode())


def _json_min(schema, depth: int) -> int:
    """Shortest compact JSON valid under `schema` (a lower bound): at least its own type's
    shortest, the shortest of its anyOf / oneOf alternatives, and each allOf part's."""
    if depth > _MAX_DEPTH or not isinstance(schema, dict):
        return 1 if schema is True else 0
    if "const" in schema:
        return _compact(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(_compact(v) for v in schema["enum"])
    if "$ref" in schema:
        return 0
    bounds = [_typed_min(schema, depth)]
    alts = [_json_min(s, depth + 1) for key in ("anyOf", "oneOf") for s in schema.get(key) or ()]
    if alts:
        bounds.append(min(alts))
    bounds += [_json_min(s, depth + 1) for s in schema.get("allOf") or ()]
    return max(bounds)


def _typed_min(schema: dict, depth: int) -> int:
    types = schema.get("type")
    if types is None:
        return 1  # any value: "0"
    if isinstance(types, str):
        types = [types]
    return min((_one_type_min(t, schema, depth) for t in types), default=0)


def _one_type_min(t: str, schema: dict, depth: int) -> int:
    if t == "object":
        req = [r for r in schema.get("required") or () if isinstance(r, str)]
        props = schema.get("properties") or {}
        body = sum(_compact(r) + _KEY_SEP + _json_min(props.get(r, {}), depth + 1) for r in req)
        return 2 + body + _ITEM_SEP * max(0, len(req) - 1)
    if t == "array":
        n = schema.get("minItems", 0)
        n = n if isinstance(n, int) and n > 0 else 0
        prefix = schema.get("prefixItems") or []
        items = [_json_min(prefix[i] if i < len(prefix) else schema.get("items", {}), depth + 1)
                 for i in range(min(n, 1024))]
        return 2 + sum(items) + _ITEM_SEP * max(0, n - 1)
    if t == "string":
        n = schema.get("minLength", 0)
        return 2 + (n if isinstance(n, int) and n > 0 else 0)
    if t in ("boolean", "null"):
        return 4  # true / null
    return 1  # a number: one digit
