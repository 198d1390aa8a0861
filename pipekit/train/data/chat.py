"""Instruction (chat) data: conversations rendered by a plain template (or a Hugging Face
chat template: `pipekit.train.data.chat_template`), the loss on the assistant's tokens only,
packed like documents so that packed conversations never attend to each other.

A `.jsonl` line is one conversation, `{"messages": [{"role": ..., "content": ...}, ...]}` with
roles system, user, assistant or tool. Each message is rendered as its header line
`<|role|>` and its content, each followed by a newline, and the conversation is framed
[BOS] ... [EOS] as a document is. The labels that count are the assistant's content and the
newline after it (and the EOS when an assistant message ends the conversation): the model learns
to answer and to stop, not to write the user's turns. Packing puts conversations back to back
as documents, and the document masks keep each one's attention to itself under slicing, context
parallelism and every other layout, so a conversation's loss does not depend on its neighbours.

Legend: T tokens, D conversations.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from pipekit.train.data.chat_template import JinjaChatTemplate, render_with_template
from pipekit.train.data.packing import TokenStream
from pipekit.train.data.tokenizer import Tokenizer

__all__ = [
    "CHAT_ROLES",
    "DATA_FORMATS",
    "chat_conversations",
    "pack_conversations",
    "render_conversation",
]

DATA_FORMATS = ("text", "chat")
"""`[data] format`'s choices: documents, or conversations with an assistant-only loss."""

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have; the assistant's content is what the loss counts."""

Message = dict[str, str]


def chat_conversations(files: Sequence[Path]) -> Iterator[list[Message]]:
    """Each `.jsonl` line's messages, checked; a bad line is a ValueError naming file:line."""
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                yield _messages(line, f"{path}:{number}")


def _messages(line: str, where: str) -> list[Message]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'{where}: a chat line is {{"messages": [{{"role": ..., "content": ...}}, ...]}} '
            "with at least one message"
        )
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in CHAT_ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: message {index} must have a role in {', '.join(CHAT_ROLES)} and a "
                "string content"
            )
    return messages


def render_conversation(
    messages: Sequence[Message], tokenizer: Tokenizer
) -> tuple[list[int], list[bool]]:
    """The conversation's token ids framed [BOS] ... [EOS], and per id whether it is a label
    that counts (the assistant's content and newline; the EOS after a final answer)."""
    ids, counts = [tokenizer.bos_id], [False]
    for message in messages:
        header = [int(t) for t in tokenizer.encode(f"<|{message['role']}|>\n")]
        body = [int(t) for t in tokenizer.encode(message["content"] + "\n")]
        ids += header + body
        counts += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    ids.append(tokenizer.eos_id)
    counts.append(messages[-1]["role"] == "assistant")
    return ids, counts


def pack_conversations(
    conversations: Iterable[Sequence[Message]],
    tokenizer: Tokenizer,
    template: JinjaChatTemplate | None = None,
) -> TokenStream:
    """Render (by `template`, or the plain template) and pack `conversations` into one
    `TokenStream` with its loss mask."""
    ids, counts, starts = [], [], []
    for messages in conversations:
        if template is None:
            rendered, counted = render_conversation(messages, tokenizer)
        else:
            rendered, counted = render_with_template(messages, template, tokenizer)
        starts.append(len(ids))
        ids += rendered
        counts += counted
    if not starts:
        raise ValueError("no conversations to pack: the source is empty")
    return TokenStream(
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int64),
        tokenizer.vocab_size,
        loss_mask_T=torch.tensor(counts, dtype=torch.bool),
    )
