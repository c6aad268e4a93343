"""Chat templates: the checkpoint's Jinja template rendered the way HF `apply_chat_template` does.

    tpl = resolve_chat_template(llm.tokenizer, llm.model.cfg)        # or override=path/text
    text = tpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = tpl.encode(...)     # = tokenizer.encode(text, add_special_tokens=False)

Where the template comes from, first found: an explicit override (`jaxinfer serve
--chat-template FILE`), the checkpoint (tokenizer_config.json `chat_template`, `chat_template.jinja`,
GGUF `tokenizer.chat_template`; see runtime/host/tokenizer.py), then a built-in template for a model
family whose turn format is fixed (Gemma 3: the GGUF of the default model carries no template,
so `GEMMA_TEMPLATE` below writes Gemma's documented turn format). Otherwise there is none and
the chat endpoint refuses with a clear error.

Rendering environment, as HF's: a sandboxed, immutable Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, `raise_exception(msg)`, `strftime_now(fmt)` and a
`tojson` filter that keeps non-ASCII text; variables `messages`, `bos_token`, `eos_token`,
`add_generation_prompt` (plus any extra keyword given). The rendered text already holds BOS when
the template writes `bos_token`, so it is tokenized without adding special tokens (HF does the
same), and special-token text such as `<start_of_turn>` maps to its control id.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "GEMMA_TEMPLATE", "resolve_chat_template"]


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or it is malformed)."""


# Gemma's turn format: a system message is folded into the first user turn (Gemma has no system
# role), roles must alternate user/assistant starting with user, the assistant's role is written
# "model", contents are stripped, and the generation prompt opens a model turn.
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(prefix='', turns=messages) -%}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "  {%- set ns.prefix = messages[0]['content'] ~ '\\n\\n' -%}\n"
    "  {%- set ns.turns = messages[1:] -%}\n"
    "{%- endif -%}\n"
    "{{- bos_token -}}\n"
    "{%- for m in ns.turns -%}\n"
    "  {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "    {{- raise_exception('roles must alternate user/assistant/user/... "
    "(after an optional system message)') -}}\n"
    "  {%- endif -%}\n"
    "  {{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n' -}}\n"
    "  {%- if loop.first %}{{ ns.prefix }}{% endif -%}\n"
    "  {{- m['content'] | trim -}}\n"
    "  {{- '<end_of_turn>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}\n"
)

_BUILTIN = {"gemma3": GEMMA_TEMPLATE}


def _raise_exception(message: str):
    raise ChatTemplateError(str(message))


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass
class ChatTemplate:
    source: str  # the template text
    origin: str  # "checkpoint" | "builtin:<family>" | "override"
    bos_token: str
    eos_token: str
    tokenizer: object

    def __post_init__(self):
        try:
            self._compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) does not parse: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        try:
            return self._compiled.render(messages=messages, bos_token=self.bos_token,
                                         eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt, **extra)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # undefined names, sandbox violations, bad filters
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        text = self.render(messages, add_generation_prompt, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False)


def _piece(tokenizer, token_id: int | None) -> str:
    return tokenizer.id_to_piece(token_id) if token_id is not None else ""


def resolve_chat_template(tokenizer, model_cfg=None, override: str | None = None) -> ChatTemplate | None:
    """The template to serve chats with, or None if there is none. `override`: a file path or
    the template text itself."""
    bos = _piece(tokenizer, tokenizer.bos_id)
    eos = _piece(tokenizer, tokenizer.eos_ids[0] if tokenizer.eos_ids else None)
    if override:
        p = Path(override)
        text = p.read_text(encoding="utf-8") if p.is_file() else override
        return ChatTemplate(text, "override", bos, eos, tokenizer)
    if getattr(tokenizer, "chat_template", None):
        return ChatTemplate(tokenizer.chat_template, "checkpoint", bos, eos, tokenizer)
    family = getattr(model_cfg, "family", None)
    if family in _BUILTIN:
        return ChatTemplate(_BUILTIN[family], f"builtin:{family}", bos, eos, tokenizer)
    return None
