"""`python -m pipekit.generate`: cached decoding equals a full forward (logits at every step,
for Llama, DeepSeek-V3's latent cache and gpt-oss's sinks and sliding window), greedy tokens
equal transformers' `generate` on a checkpoint transformers wrote, sampling is seeded and
filtered, and the command runs on a checkpoint a job just wrote (the job's config beside it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from hf_reference import TINY_HF_CONFIG, save_transformers_model

from pipekit.attention.context import SlicedKVCache
from pipekit.config import load_job_config
from pipekit.generate import Sampling, decode_tokens, load_for_generation
from pipekit.generate.__main__ import main as generate_main
from pipekit.models import get_model_spec
from pipekit.testing import build_model
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 17, 5, 42, 9, 3, 27]


def _cached_and_full_logits(model: torch.nn.Module, tokens: list[int], prompt: int) -> tuple:
    """Logits of positions prompt-1.. decoded with the cache (prompt, then one token at a
    time) and from one full forward of all `tokens`."""
    cache, cached = SlicedKVCache(backend="auto"), []
    with torch.no_grad():
        pieces = [tokens[:prompt], *([token] for token in tokens[prompt:])]
        start = 0
        for piece in pieces:
            positions = torch.arange(start, start + len(piece)).unsqueeze(0)
            cached.append(model(torch.tensor([piece]), positions, cache)[0, -1])
            start += len(piece)
        full = model(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0))[0]
    return torch.stack(cached), full[prompt - 1 :]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gpt_oss"])
def test_cached_decoding_equals_the_full_forward(family: str) -> None:
    spec = get_model_spec(family)
    flavor = "debug_latent" if family == "deepseek_v3" else "debug"
    model = build_model(spec, spec.flavor(flavor), seed=0, dtype=torch.float64).eval()
    tokens = [*PROMPT, *range(60, 88)]  # 35 tokens: past gpt-oss' window of 32
    cached, full = _cached_and_full_logits(model, tokens, len(PROMPT))
    assert (cached - full).abs().max() < 1e-10 * full.abs().max()
    written = list(decode_tokens(model, PROMPT, 4))
    greedy = list(PROMPT)
    for _ in range(4):  # the full forward's argmax, token by token
        with torch.no_grad():
            logits = model(torch.tensor([greedy]), torch.arange(len(greedy)).unsqueeze(0))
        greedy.append(int(logits[0, -1].argmax()))
    assert written == greedy[len(PROMPT) :]


def test_greedy_tokens_equal_transformers_generate(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY_HF_CONFIG)
    hf_model = save_transformers_model(transformers.LlamaForCausalLM, config, tmp_path / "hf")
    model, _, max_seq_len = load_for_generation(tmp_path / "hf", tokenizer="bytes")
    assert max_seq_len == config.max_position_embeddings
    ours = list(decode_tokens(model, PROMPT, 20, max_seq_len=max_seq_len))
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()  # fmt: skip
    assert ours == theirs


def test_sampling_is_seeded_and_filtered() -> None:
    logits_V = torch.tensor([5.0, 4.0, 3.0, -1.0, -2.0])

    def draw(sampling: Sampling, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sampling.pick(logits_V, generator) for _ in range(50)]

    warm = Sampling(temperature=1.0)
    assert draw(warm, 1) == draw(warm, 1)
    assert set(draw(Sampling(temperature=5.0, top_k=2), 2)) == {0, 1}
    assert set(draw(Sampling(temperature=1.0, top_p=0.5), 3)) == {0}
    assert Sampling().pick(logits_V, torch.Generator()) == 0
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        Sampling(top_p=0.0)


def test_the_command_continues_a_prompt_from_a_job_checkpoint(tmp_path: Path, capsys) -> None:
    """Two training steps write a checkpoint and the job's config.toml; the command reads
    both (no --config) and prints the prompt's continuation; bad input is one line, exit 2."""
    output = tmp_path / "job"
    config = load_job_config([
        "--config", str(REPO_ROOT / "configs" / "debug_model.toml"), "--job.output_dir",
        str(output), "--training.steps", "2", "--training.global_batch_size", "4",
        "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "1",
        "--checkpoint.interval", "2", "--checkpoint.resume", "false",
        "--parallelism.dp_shard", "1", "--metrics.peak_flops", "1e9",
    ])  # fmt: skip
    Trainer(validate_job(config, world_size=1)).train()
    assert (output / "config.toml").is_file()
    capsys.readouterr()
    step = str(output / "checkpoints" / "step-2")
    assert generate_main(["--checkpoint", step, "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("def ") and "tokens/s" in printed.err
    bad = generate_main(["--checkpoint", str(output / "checkpoints"), "--prompt", "def "])
    lines = capsys.readouterr().err.strip().splitlines()
    assert bad == 2 and len(lines) == 1 and "neither a Hugging Face folder" in lines[0]
    # positions past the model's longest sequence are refused before any forward
    longest = validate_job(config, world_size=1).shape.max_seq_len
    too_many = ["--checkpoint", step, "--prompt", "def ", "--max-new-tokens", str(longest)]
    assert generate_main(too_many) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"past the model's max_seq_len={longest}" in lines[0], lines


def test_decoding_refuses_positions_past_the_longest_sequence() -> None:
    """Positions 0..P+N-2 are fed (the last token picked is only yielded): P + N - 1 tokens
    fit exactly, one more is refused before any forward."""
    model = torch.nn.Linear(1, 1)  # never run: the refusal comes first
    fits = decode_tokens(model, [1, 2, 3], 6, max_seq_len=8)
    assert iter(fits) is fits
    with pytest.raises(ValueError, match=r"ask for at most 6 new tokens"):
        decode_tokens(model, [1, 2, 3], 7, max_seq_len=8)
