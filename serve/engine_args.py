"""The engine options every `jaxinfer` command takes, and the LLM they build. Every flag but
--model and --lora-modules is a row of ENGINE_OPTIONS (runtime/config.py): its spelling, values
and help come from there; this module only picks the argparse style of each row:

    row                                      flag                                 given as
    bool, default False                      --enable-lora                        True
    bool, default True                       --no-async-scheduling                False
    bool, default None (or cli="pair")       --fuse-projections / --no-fuse-...   True / False
    str with choices, int, float             --dtype bfloat16, --max-slots 16     the value
    cli="json"                               --speculative '{"method": "ngram"}'  the JSON value

A flag not given leaves its attribute None and its option out of `engine_kwargs(args)`, so
LLM's own defaults hold (it derives max_model_len and tensor_parallel from the model);
`llm_from_args` turns warmup on for `serve` unless a flag says otherwise.

The sampling flags of `batch` and `generate` come the same way from the request door's table
(SAMPLING_FIELDS, runtime/host/requests.py): `sampling_args` adds one per row (a command may give
its own defaults), `sampling_kwargs` reads back the given ones as SamplingParams keywords.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

from jaxinfer.checkpoints.named import DEFAULT_MODEL
from jaxinfer.runtime.config import ENGINE_OPTIONS, Option
from jaxinfer.runtime.host.requests import SAMPLING_FIELDS, Field


def engine_args(p: argparse.ArgumentParser, options: tuple[Option, ...] = ENGINE_OPTIONS) -> None:
    """--model, a flag per option of `options` that has one, --lora-modules."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint dir, .gguf file, `jaxinfer convert` dir, or a model name "
                        f"(default: {DEFAULT_MODEL})")
    g = p.add_argument_group("engine options (LLM keyword arguments of the same names)")
    option_flags(g, *(o.name for o in options if o.flag is not None), options=options)
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT adapters to load at start; requests name them (HTTP `model`, "
                        "gRPC `lora`, JSONL `lora`)")


def option_flags(p, *names: str, options: tuple[Option, ...] = ENGINE_OPTIONS, **defaults) -> None:
    """The flags of the options `names` (a tool picks the few it varies); `defaults`: a tool's
    own value of an option when its flag is not given (else None: not given)."""
    rows = {o.name: o for o in options}
    for name in names:
        flags, kw = _flag(rows[name])
        v = defaults.get(name)
        if v is not None and v != rows[name].default:
            kw["help"] += f"; this command's default: {v}"
        p.add_argument(*flags, **kw, default=v)


def _flag(o: Option) -> tuple[list[str], dict]:
    """The argparse flags and keywords of one row (dest: the option's name)."""
    dashed = o.name.replace("_", "-")
    kw = dict(dest=o.name, help=_help(o).replace("%", "%%"))
    if o.type is bool and (o.nullable or o.cli == "pair"):
        kw |= dict(action=argparse.BooleanOptionalAction)
    elif o.type is bool:  # given: the switch turns the default over
        kw |= dict(action="store_const", const=not o.default)
        dashed = f"no-{dashed}" if o.default else dashed
    elif o.cli == "json":
        kw |= dict(type=_json, metavar="JSON")
    elif o.choices:
        kw |= dict(choices=o.choices)
    else:
        kw |= dict(type=o.type, metavar=o.type.__name__.upper())
    return [o.flag or f"--{dashed}"], kw


def _help(o: Option) -> str:
    if o.type is bool and not (o.nullable or o.cli == "pair"):
        return f"turn off (on by default): {o.help}" if o.default else o.help
    if o.default is None or "default" in o.help:
        return o.help
    return f"{o.help} (default: {o.default})"


def _json(text: str):
    try:
        return json.loads(text)
    except RecursionError:  # argparse reports a ValueError as "invalid JSON value"
        raise ValueError("nested too deeply") from None


_json.__name__ = "JSON"  # argparse: "invalid JSON value: ..."


def engine_kwargs(args: argparse.Namespace, options: tuple[Option, ...] = ENGINE_OPTIONS) -> dict:
    """The options whose flags were given (or a tool defaulted), by name: LLM keyword arguments."""
    return {o.name: v for o in options if (v := getattr(args, o.name, None)) is not None}


# ---- sampling flags: one per row of the request door's table (runtime/host/requests.py) -------
#     kind            flag                                   given as
#     int, float      --max-tokens 64, --top-p 0.9           the value
#     bool            --ignore-eos                           True (--no-x: a row True by default)
#     strings, ids    --stop S, --stop-token-ids ID          repeatable: a tuple
#     structured      --structured-outputs '{"regex": ...}'  the JSON value
#     bias            --logit-bias '{"5": 2.0}'              the JSON value
def sampling_args(p, *, title: str = "sampling (SamplingParams fields of the same names)",
                  skip: tuple[str, ...] = (), table: Mapping[str, Field] = SAMPLING_FIELDS,
                  **defaults) -> None:
    """A flag per sampling field but `skip` (fields meaningless to the command), in a group
    `title`; `defaults`: the command's value of a field when its flag is not given (else None:
    not given, the field's own default holds). `sampling_kwargs(args)` reads them back."""
    g = p.add_argument_group(title)
    for name, f in table.items():
        if name in skip:
            continue
        v = defaults.get(name)
        shown = f.default if v is None else v
        quiet = shown is None or shown == () or isinstance(shown, bool)  # said by the doc
        help_ = f.doc if quiet else f"{f.doc} (default: {shown})"
        kw = dict(dest=name, default=v, help=help_.replace("%", "%%"))
        if f.kind == "bool":  # given: the switch turns the default over
            kw |= dict(action="store_const", const=not f.default)
        elif f.kind in ("strings", "ids"):
            kw |= dict(action="append", type=int if f.kind == "ids" else str,
                       metavar="ID" if f.kind == "ids" else "STR", help=kw["help"] + "; repeatable")
        elif f.kind in ("structured", "bias"):
            kw |= dict(type=_json, metavar="JSON")
        else:
            t = int if f.kind == "int" else float
            kw |= dict(type=t, metavar=t.__name__.upper())
        g.add_argument(f"--{'no-' if f.default is True else ''}{name.replace('_', '-')}", **kw)


def sampling_kwargs(args: argparse.Namespace,
                    table: Mapping[str, Field] = SAMPLING_FIELDS) -> dict:
    """The sampling fields whose flags were given (or the command defaulted), by name:
    SamplingParams keyword arguments (a repeated flag's values as a tuple)."""
    return {name: tuple(v) if isinstance(v, list) else v
            for name in table if (v := getattr(args, name, None)) is not None}


def llm_from_args(args):
    """The LLM of the engine flags (`args` may be any Namespace holding them: Ray replicas
    rebuild one from `vars(args)`). On a follower of a --distributed job it follows the leader's
    steps and exits."""
    from jaxinfer.runtime.llm import LLM

    options = engine_kwargs(args)
    modules = lora_modules(getattr(args, "lora_modules", None) or [])
    if modules:
        options["enable_lora"] = True
    options.setdefault("warmup", getattr(args, "cmd", None) == "serve")
    llm = LLM(getattr(args, "model", DEFAULT_MODEL), **options)
    if options.get("distributed"):
        if not llm.engine.leader:  # a follower runs the leader's steps until released
            llm.engine.follow()
            sys.exit(0)
        import atexit

        atexit.register(llm.engine.release_followers)
        return llm
    for name, path in modules.items():
        try:
            llm.engine.add_lora(name, path)
        except ValueError as e:
            raise SystemExit(f"--lora-modules {name}={path}: {e}") from None
    return llm


def lora_modules(items: list[str]) -> dict[str, str]:
    """["name=path", ...] -> {name: path}; SystemExit naming a malformed or repeated item."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: expected NAME=PATH, got {item!r}")
        if name in out:
            raise SystemExit(f"--lora-modules: adapter name {name!r} given twice")
        out[name] = path
    return out
