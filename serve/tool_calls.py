"""Tool calling on the chat API: OpenAI `tools` + `tool_choice` -> a prompt that lists the tools,
a constraint when a call is required, and `tool_calls` parsed back from the model's text.

    plan = parse_tools(body)                       # RequestError naming the field
    messages = with_tools(messages, plan, template)
    so = plan.constraint                           # StructuredOutputs when a call is forced
    calls = plan.calls(text)                       # [{"id", "type", "function"}] or None

Earlier turns may hold calls and their results: an assistant message with `tool_calls` and
`role: "tool"` messages answering them by `tool_call_id` (checked by `check_tool_calls` and
`tool_result`). Templates that render `tool_calls` get them as they are (arguments as objects);
for the others `plain_turns` writes a call as the JSON the model was told to answer with and
the results as one user message.

Templates that take a `tools` variable render the tools themselves (passed as `tools=`); for
the others (Gemma's has none) a system message lists each function and the call format. The
call format is one JSON object per call, `{"name": ..., "arguments": {...}}` (an array of them
when parallel calls are allowed). `tool_choice`: "none" (no call), "auto" (the model decides:
its text becomes a call when it parses as one of the tools'), "required" (a constrained call to
any tool), or {"type": "function", "function": {"name": N}} (a constrained call to N).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from jaxinfer.runtime.host.requests import RequestError
from jaxinfer.runtime.host.structured import StructuredOutputs

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]  # {"name", "description", "parameters"} per function
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None  # the named function
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def _call_schema(self, fn: dict) -> dict:
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]}}

    @functools.cached_property
    def constraint(self) -> StructuredOutputs | None:
        """The JSON a forced call must be (None: the model writes freely)."""
        if not self.forced:
            return None
        fns = [f for f in self.tools if self.mode == "required" or f["name"] == self.name]
        one = self._call_schema(fns[0]) if len(fns) == 1 else {
            "anyOf": [self._call_schema(f) for f in fns]}
        if self.mode == "named" or not self.parallel:
            return StructuredOutputs(json=one)
        return StructuredOutputs(json={"type": "array", "minItems": 1,
                                       "maxItems": MAX_PARALLEL_CALLS, "items": one})

    def calls(self, text: str) -> list[dict] | None:
        """The model's text as OpenAI tool calls, or None when it is not a call."""
        if self.mode == "none":
            return None
        s = text.strip()
        m = re.fullmatch(r"<tool_call>(.*)</tool_call>", s, re.S)  # Hermes-style tags
        try:
            got = json.loads(m.group(1) if m else s)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser
            return None
        items = got if isinstance(got, list) else [got]
        names = {f["name"] for f in self.tools}
        # Llama 3.x templates ask for "parameters" where others say "arguments"
        args = [c.get("arguments", c.get("parameters", {})) if isinstance(c, dict) else None
                for c in items]
        if not items or not all(isinstance(c, dict) and c.get("name") in names
                                and isinstance(a, dict) for c, a in zip(items, args)):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(a, ensure_ascii=False)}}
                for c, a in zip(items, args)]


def parse_tools(body: dict) -> ToolPlan | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice", "needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(
                t.get("function"), dict):
            raise RequestError(where, 'must be {"type": "function", "function": {...}}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(f"{where}.function.name", "must be 1-64 letters, digits, _ or -")
        if name in seen:
            raise RequestError(f"{where}.function.name", f"duplicate function {name!r}")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters", "must be a JSON schema object")
        try:  # JSON (no NaN, not too deep), whatever tool_choice is
            StructuredOutputs(json=params)
        except RequestError as e:
            raise RequestError(f"{where}.function.parameters", e.reason) from None
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise RequestError(f"{where}.function.description", "must be a string")
        out.append({"name": name, "description": desc, "parameters": params})
    mode, name = "auto", None
    if choice is None or choice in ("none", "auto", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in seen:
            raise RequestError("tool_choice", f"names no function in 'tools': {name!r}")
        mode = "named"
    else:
        raise RequestError("tool_choice", 'must be "none", "auto", "required" or '
                                          '{"type": "function", "function": {"name": ...}}')
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", "must be a boolean")
    return ToolPlan(tuple(out), mode, name, parallel)


def check_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls` -> [{"id", "type", "function": {"name", "arguments"
    (an object)}}]; RequestError naming the entry otherwise."""
    if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_TOOLS:
        raise RequestError(where, f"must be a list of 1..{MAX_TOOLS} calls")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise RequestError(at, 'must be {"id", "type": "function", "function": {...}}')
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise RequestError(f"{at}.id", "must be a non-empty string")
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise RequestError(f"{at}.function.name", "must be 1-64 letters, digits, _ or -")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, RecursionError):  # not JSON, or nested past the parser
            args = None
        if not isinstance(args, dict):
            raise RequestError(f"{at}.function.arguments", "must be a JSON object (as text)")
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def tool_result(m: dict, calls: dict[str, str], where: str) -> dict:
    """A `role: "tool"` message answering one of `calls` (id -> function name, the calls of
    the assistant message before it) -> {"role": "tool", "tool_call_id", "name"}."""
    tid = m.get("tool_call_id")
    if not isinstance(tid, str) or tid not in calls:
        known = ", ".join(map(repr, calls)) or "none: no assistant tool_calls precede it"
        raise RequestError(f"{where}.tool_call_id", f"must name a call of the assistant message "
                                                    f"before it ({known}), got {tid!r}"[:300])
    return {"role": "tool", "tool_call_id": tid, "name": calls[tid]}


def plain_turns(messages: list[dict]) -> list[dict]:
    """Tool turns for a template that renders no `tool_calls`: a call becomes the assistant's
    JSON answer in the format `with_tools` asks for, and each run of results one user message."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m["tool_calls"]]
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            out.append({"role": "assistant",
                        "content": f"{m['content']}\n{text}" if m["content"] else text})
        elif m["role"] == "tool":
            line = f"Result of {m['name']} (call {m['tool_call_id']}): {m['content']}"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + line}
            else:
                out.append({"role": "user", "content": line, "tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def with_tools(messages: list[dict], plan: ToolPlan, template) -> tuple[list[dict], dict]:
    """(messages, extra template variables) that tell the model its tools."""
    if plan.mode == "none":
        return messages, {}
    if "tools" in template.source:  # the template renders them in its model's own format
        return messages, {"tools": [{"type": "function", "function": f} for f in plan.tools]}
    lines = ["You can call these functions. To call one, answer with only a JSON object "
             '{"name": <function name>, "arguments": <arguments object>}'
             + (" (or a JSON array of such objects for several calls)." if plan.parallel else ".")]
    for f in plan.tools:
        lines.append(f"- {f['name']}: {f['description']} Arguments schema: "
                     f"{json.dumps(f['parameters'], ensure_ascii=False)}")
    system = {"role": "system", "content": "\n".join(lines)}
    if messages and messages[0]["role"] == "system":
        merged = {"role": "system", "content": messages[0]["content"] + "\n\n" + system["content"]}
        return [merged, *messages[1:]], {}
    return [system, *messages], {}
