"""Hugging Face chat templates: pipekit renders a tokenizer's Jinja template as transformers
does (text and ids), counts exactly the assistant's turns (answer and end-of-turn token), and
refuses in one line a template that rewrites earlier turns, one that reaches outside its
sandbox, and settings that cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipekit.config.job_config import DataConfig
from pipekit.train.data import load_token_stream
from pipekit.train.data.chat_template import load_chat_template, render_with_template
from pipekit.train.data.loader import check_data_config
from pipekit.train.data.tokenizer import LLAMA3_BOS, LLAMA3_EOS, build_tokenizer

# The tokenizers library starts its thread pool in the process that encodes; each test runs in a
# forked child so the pytest process, from which later tests fork rank groups, stays
# single-threaded.
pytestmark = pytest.mark.own_process

CHAT = Path(__file__).resolve().parents[1] / "data" / "chat.jsonl"
SPECIALS = ["[UNK]", LLAMA3_BOS, LLAMA3_EOS, "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]  # fmt: skip
TURNS = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "repeat apple"},
    {"role": "assistant", "content": "apple"},
    {"role": "user", "content": "repeat cloud twice"},
    {"role": "assistant", "content": "cloud cloud"},
]


def _tokenizer_folder(folder: Path, template: str | None = TURNS) -> Path:
    """A word-level tokenizer.json with Llama 3's turn tokens, and its tokenizer_config.json."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "system user assistant answer briefly repeat apple cloud twice"
    tokenizer.train_from_iterator([words], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": LLAMA3_BOS, "eos_token": LLAMA3_EOS}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def test_the_tokenizers_template_renders_as_transformers_and_counts_the_answers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _tokenizer_folder(tmp_path)
    tokenizer = build_tokenizer(str(path))
    template = load_chat_template("tokenizer", tokenizer)
    assert template is not None
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token=LLAMA3_BOS, eos_token=LLAMA3_EOS
    )
    reference.chat_template = TURNS
    for prompt in (False, True):
        assert template.render(CONVERSATION, prompt) == reference.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=prompt
        )
    ids, counted = render_with_template(CONVERSATION, template, tokenizer)
    text = reference.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    end_of_turn = tokenizer.encode("<|eot_id|>")
    answers = [tokenizer.encode(text) + end_of_turn for text in ("apple", "cloud cloud")]
    assert [i for i, c in zip(ids, counted, strict=True) if c] == answers[0] + answers[1]

    files = {"source": str(CHAT), "tokenizer": str(path)}
    stream = load_token_stream(DataConfig(**files, format="chat", chat_template="tokenizer"))
    assert stream.loss_mask_T is not None and 0 < int(stream.loss_mask_T.sum()) < stream.num_tokens
    assert int(stream.tokens_T[0]) == tokenizer.bos_id  # the template writes the BOS itself


def test_bad_templates_and_settings_are_one_line(tmp_path):
    tokenizer = build_tokenizer(str(_tokenizer_folder(tmp_path / "turns")))
    cases = {
        "{{ messages | length }} turns: " + TURNS: "does not render a conversation as a prefix",
        "{% set _ = messages.append(messages[0]) %}" + TURNS: "'append' of 'list' .* unsafe",
        "{{ ''.__class__.__mro__ }}": "'__class__' of 'str' object is unsafe",
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}":
            "user first",
    }  # fmt: skip
    for index, (source, message) in enumerate(cases.items()):
        file = tmp_path / f"case{index}.jinja"
        file.write_text(source)
        template = load_chat_template(str(file), tokenizer)
        with pytest.raises(ValueError, match=message):
            render_with_template(CONVERSATION, template, tokenizer)
    (tmp_path / "broken.jinja").write_text("{% for message in messages %}")
    with pytest.raises(ValueError, match=r"broken.jinja:1: .*endfor"):
        load_chat_template(str(tmp_path / "broken.jinja"), tokenizer)

    bare = _tokenizer_folder(tmp_path / "bare", template=None)
    settings = {
        (str(bare), "tokenizer", "chat"): "has no chat_template.jinja and no chat_template",
        ("bytes", "tokenizer", "chat"): "special tokens of a Hugging Face tokenizer",
        (str(bare), str(tmp_path / "no.jinja"), "chat"): "is not a file",
        (str(bare), "tokenizer", "text"): "set format = 'chat'",
    }
    for (tokenizer_spec, chat_template, data_format), message in settings.items():
        config = DataConfig(source=str(CHAT), format=data_format, tokenizer=tokenizer_spec,
                            chat_template=chat_template)  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_data_config(config)
