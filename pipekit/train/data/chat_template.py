"""Hugging Face chat templates: conversations rendered by the Jinja template a tokenizer ships
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`) or by a `.jinja` file,
with the loss on the assistant's turns.

A template is data, not code: it runs in Jinja's immutable sandbox, which refuses Python's
internals (attributes starting with `_`, mutating methods), as Hugging Face's own renderer does.

The assistant's turn i is the text the template adds between the conversation before it,
rendered with the generation prompt, and the conversation through it: the answer and whatever
the template closes a turn with (`<|eot_id|>`, `<|im_end|>`), which the model must learn in
order to stop. So a template must render a conversation as a prefix of its continuations; one
that rewrites earlier turns (dropping earlier reasoning, say) is refused with one line. The
text is tokenized piece by piece at those boundaries, as generation tokenizes a prompt and
appends the model's tokens, so no token straddles a prompt and its answer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipekit.train.data.tokenizer import Tokenizer

__all__ = [
    "PLAIN_TEMPLATE",
    "TOKENIZER_TEMPLATE",
    "JinjaChatTemplate",
    "load_chat_template",
    "render_with_template",
]

PLAIN_TEMPLATE = "plain"
"""`[data] chat_template`: pipekit's documented plain template (any tokenizer)."""
TOKENIZER_TEMPLATE = "tokenizer"
"""`[data] chat_template`: the template beside the tokenizer.json."""

_TEMPLATE_FILE = "chat_template.jinja"
_TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class JinjaChatTemplate:
    """A chat template's Jinja source, where it came from (for messages), and the special
    tokens it may name."""

    source: str
    origin: str
    bos_token: str
    eos_token: str

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        """The conversation's text; ValueError naming the template on any template error."""
        from jinja2 import TemplateError

        try:
            return _compiled(self.source).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as error:
            raise ValueError(f"chat template {self.origin}: {error}") from None


def load_chat_template(setting: str, tokenizer: Tokenizer) -> JinjaChatTemplate | None:
    """None for the plain template; else the template `setting` names ("tokenizer", or a
    `.jinja` file), compiled once to check it; ValueError naming the fix."""
    if setting == PLAIN_TEMPLATE:
        return None
    path = getattr(tokenizer, "path", None)
    bos, eos = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
    if path is None or bos is None or eos is None:
        raise ValueError(
            f"chat_template={setting!r} renders the special tokens of a Hugging Face "
            "tokenizer; set tokenizer to a tokenizer.json, or chat_template = 'plain'"
        )
    if setting == TOKENIZER_TEMPLATE:
        source, origin = _tokenizer_template(Path(path).parent)
    else:
        file = Path(setting).expanduser()
        if not file.is_file():
            raise ValueError(
                f"chat_template={setting!r} is not a file; give 'plain', 'tokenizer' or the "
                "path of a .jinja template"
            )
        source, origin = file.read_text(encoding="utf-8"), str(file)
    from jinja2 import TemplateSyntaxError

    try:
        _compiled(source)
    except TemplateSyntaxError as error:
        raise ValueError(f"chat template {origin}:{error.lineno}: {error.message}") from None
    return JinjaChatTemplate(source, origin, bos, eos)


def _tokenizer_template(folder: Path) -> tuple[str, str]:
    """The template a Hugging Face tokenizer folder ships, and its file."""
    jinja = folder / _TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config = folder / _TOKENIZER_CONFIG
    template: Any = None
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            raise ValueError(f"{config}: not a JSON object") from None
    if isinstance(template, list):  # named templates: the default one
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(
            f"chat_template = 'tokenizer': {folder} has no {_TEMPLATE_FILE} and no "
            f"chat_template in {_TOKENIZER_CONFIG}; give a .jinja file or chat_template = 'plain'"
        )
    return template, str(config)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in Jinja's immutable sandbox, with the helpers chat templates
    use (`raise_exception`, `tojson` that keeps non-ASCII text)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = tojson
    return environment.from_string(source)


def render_with_template(
    messages: Sequence[Mapping[str, str]], template: JinjaChatTemplate, tokenizer: Tokenizer
) -> tuple[list[int], list[bool]]:
    """The conversation's token ids as `template` renders it, and per id whether it is a
    label that counts (the assistant's turns, see the module docstring)."""
    whole = template.render(messages, add_generation_prompt=False)
    pieces: list[tuple[str, bool]] = []
    done = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:index], add_generation_prompt=True)
        through = template.render(messages[: index + 1], add_generation_prompt=False)
        if not (len(prompt) >= done and through.startswith(prompt) and whole.startswith(through)):
            raise ValueError(
                f"chat template {template.origin} does not render a conversation as a prefix of "
                f"its continuations (message {index} changes the text before it), so the "
                "assistant's turns cannot be told apart; use a template that does, or 'plain'"
            )
        pieces += [(whole[done : len(prompt)], False), (whole[len(prompt) : len(through)], True)]
        done = len(through)
    pieces.append((whole[done:], False))
    ids: list[int] = []
    counts: list[bool] = []
    for text, counted in pieces:
        if text:
            piece = [int(token) for token in tokenizer.encode(text)]
            ids += piece
            counts += [counted] * len(piece)
    if not ids:
        raise ValueError(f"chat template {template.origin} renders a conversation as no text")
    return ids, counts
