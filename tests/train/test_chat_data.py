"""Instruction data: the loss counts the assistant's tokens only, packing changes no
conversation's loss (document masks), bad lines name file:line, and a 2-rank job trains on the
shipped chat file."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY_LLAMA

from pipekit.attention.context import CausalAttention
from pipekit.config.job_config import DataConfig
from pipekit.layers.loss import IGNORE_INDEX
from pipekit.models import get_model_spec
from pipekit.testing import build_model
from pipekit.train.data import load_token_stream
from pipekit.train.data.chat import pack_conversations, render_conversation
from pipekit.train.data.loader import check_data_config
from pipekit.train.data.tokenizer import ByteTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = REPO_ROOT / "tests" / "data" / "chat.jsonl"
BYTES = ByteTokenizer()
QUESTION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
CHAT_TWO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_only_the_assistant_tokens_are_labels() -> None:
    ids, counted = render_conversation(QUESTION, BYTES)
    text = bytes(i for i in ids if i < 256).decode()
    assert text == "<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n4\n"
    assert [i for i, c in zip(ids, counted, strict=True) if c] == [
        ord("4"),
        ord("\n"),
        BYTES.eos_id,
    ]
    stream = pack_conversations([QUESTION, CHAT_TWO], BYTES)
    row = stream.rows(torch.tensor([0]), stream.num_tokens - 1)
    labels = [int(t) for t in row["labels"][0] if t != IGNORE_INDEX]
    expected = [ord("4"), ord("\n"), BYTES.eos_id, *b"hello\n", BYTES.eos_id]
    assert labels == expected


def test_packing_changes_no_conversations_loss() -> None:
    """A conversation's per-token losses inside a packed row (after another conversation)
    equal its losses alone: document masks and positions restart it (float64). Without the
    document mask (the ablation) they do not."""
    args = dataclasses.replace(TINY_LLAMA, vocab_size=BYTES.vocab_size)
    model = build_model(get_model_spec("llama"), args, seed=0, dtype=torch.float64).eval()

    def token_losses(conversations, masked: bool = True) -> torch.Tensor:
        stream = pack_conversations(conversations, BYTES)
        batch = stream.rows(torch.tensor([0]), stream.num_tokens - 1)
        context = CausalAttention(batch["document_ids"] if masked else None)
        with torch.no_grad():
            logits = model(batch["tokens"], batch["positions"], context)
        labels = batch["labels"][0]
        losses = F.cross_entropy(logits[0], labels, ignore_index=IGNORE_INDEX, reduction="none")
        return losses[labels != IGNORE_INDEX]

    alone = token_losses([CHAT_TWO])
    packed = token_losses([QUESTION, CHAT_TWO])[-alone.numel() :]
    assert (packed - alone).abs().max() < 1e-12
    unmasked = token_losses([QUESTION, CHAT_TWO], masked=False)[-alone.numel() :]
    assert (unmasked - alone).abs().max() > 1e-3


def test_bad_chat_lines_and_sources_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": CHAT_TWO})
        + "\n"
        + json.dumps({"messages": [{"role": "bot", "content": "x"}]})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: message 0 must have a role in system"):
        load_token_stream(DataConfig(source=str(bad), format="chat"))
    with pytest.raises(ValueError, match=r"format = 'chat' reads \.jsonl files"):
        check_data_config(DataConfig(format="chat"))


def test_a_two_rank_job_trains_on_the_shipped_chat_file(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(REPO_ROOT / "train.py"), "--config", str(REPO_ROOT / "configs" / "debug_model.toml"),
        "--data.format", "chat", "--data.source", str(CHAT), "--training.seq_len", "128",
        "--training.global_batch_size", "8", "--training.steps", "12",
        "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "false",
        "--job.output_dir", str(tmp_path / "sft"),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=REPO_ROOT)
    rows = [
        json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [row["loss"] for row in rows]
    assert losses[-1] < 0.6 * losses[0], losses
