"""Data pipeline: tokenizers, sources, packing invariants, dp sharding and exact resume."""

import dataclasses
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from packed_rows import assert_positions_restart_per_row

from pipekit.config import ConfigError, load_job_config
from pipekit.config.job_config import DataConfig
from pipekit.train.data import (
    IGNORE_INDEX,
    LLAMA3_BOS,
    LLAMA3_EOS,
    ByteTokenizer,
    HFTokenizer,
    PackedDataLoader,
    build_data_loader,
    build_tokenizer,
    iter_documents,
    load_token_stream,
    pack_documents,
    source_files,
    stdlib_files,
)
from pipekit.train.data.loader import check_data_config
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

# `datasets` (pyarrow's allocator and thread pools, tqdm's monitor) and DataLoader workers (queue
# feeder threads) leave threads in the process that uses them. Each test here runs in a forked
# child, so the pytest process, from which later tests fork their rank groups, stays
# single-threaded: forking a threaded process copies only the calling thread.
pytestmark = pytest.mark.own_process

BYTES = ByteTokenizer()


def _texts(count: int, seed: int = 0, max_len: int = 40) -> list[str]:
    """Documents of varied lengths, some longer than the rows they are packed into."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (count,), generator=generator).tolist()
    alphabet = "abcdefghij é€😀\n"
    texts = []
    for index, length in enumerate(lengths):
        picks = torch.randint(len(alphabet), (length,), generator=generator).tolist()
        texts.append(f"{index}:" + "".join(alphabet[pick] for pick in picks))
    return texts


def _reference_rows(texts: list[str], seq_len: int) -> list[dict[str, list[int]]]:
    """Packing written the obvious way, one token at a time."""
    stream, document_of, position_of = [], [], []
    for index, text in enumerate(texts):
        framed = [BYTES.bos_id, *text.encode("utf-8"), BYTES.eos_id]
        stream += framed
        document_of += [index] * len(framed)
        position_of += list(range(len(framed)))
    rows = []
    for row in range((len(stream) - 1) // seq_len):
        span = range(row * seq_len, (row + 1) * seq_len)
        first_document = document_of[span[0]]
        rows.append(
            {
                "tokens": [stream[t] for t in span],
                "labels": [
                    stream[t + 1] if document_of[t + 1] == document_of[t] else IGNORE_INDEX
                    for t in span
                ],
                # a document continued from the previous row counts from the row's start
                "positions": [min(position_of[t], t - span[0]) for t in span],
                "document_ids": [document_of[t] - first_document for t in span],
            }
        )
    return rows


def test_byte_tokenizer_round_trips_utf8_with_special_ids():
    text = "def f(x):\n    return 'é€😀'\n"
    ids = BYTES.encode(text)
    assert ids.dtype == torch.int64 and ids.tolist() == list(text.encode("utf-8"))
    assert BYTES.decode(ids) == text
    assert (BYTES.vocab_size, BYTES.bos_id, BYTES.eos_id) == (258, 256, 257)
    assert BYTES.decode([BYTES.bos_id, *ids.tolist(), BYTES.eos_id]) == text
    ids_T, lengths_D = BYTES.encode_many(["ab", "", "é"])
    assert ids_T.tolist() == [97, 98, 0xC3, 0xA9] and lengths_D.tolist() == [2, 0, 2]


@pytest.mark.parametrize("seq_len", [1, 3, 7, 64])
def test_packed_rows_equal_token_by_token_reference(seq_len):
    texts = _texts(30)
    stream = pack_documents(texts, BYTES)
    batch = stream.rows(torch.arange(stream.num_rows(seq_len)), seq_len)
    reference = _reference_rows(texts, seq_len)
    assert batch.batch_size == torch.Size([len(reference), seq_len])
    for key in ("tokens", "labels", "positions", "document_ids"):
        assert batch[key].dtype == torch.int64
        assert batch[key].tolist() == [row[key] for row in reference], key


def test_packing_invariants_on_a_shuffled_batch():
    seq_len = 16
    stream = pack_documents(_texts(50, seed=1), BYTES)
    batch = stream.rows(torch.randperm(stream.num_rows(seq_len))[:12], seq_len)
    tokens, labels = batch["tokens"], batch["labels"]
    positions, document_ids = batch["positions"], batch["document_ids"]
    starts = positions == 0
    # a document starts (position 0) exactly at its BOS or, continued, at the row's first token;
    # every label is the next token, except -100 exactly where the next token starts another
    # document (after EOS)
    assert torch.equal(starts[:, 1:], tokens[:, 1:] == BYTES.bos_id)
    assert (positions[:, 0] == 0).all() and (positions < seq_len).all()
    assert torch.equal(labels == IGNORE_INDEX, tokens == BYTES.eos_id)
    assert not (labels == BYTES.bos_id).any()
    kept = labels[:, :-1] != IGNORE_INDEX
    assert torch.equal(labels[:, :-1][kept], tokens[:, 1:][kept])
    # document ids start at 0, step by one exactly where a document starts, positions count on
    assert (document_ids[:, 0] == 0).all()
    steps = document_ids[:, 1:] - document_ids[:, :-1]
    assert torch.equal(steps, starts[:, 1:].long())
    same = steps == 0
    assert torch.equal(positions[:, 1:][same], positions[:, :-1][same] + 1)
    assert (tokens[:, 0] != BYTES.bos_id).any(), "some row should continue a document"


def test_pack_rejects_an_empty_source():
    with pytest.raises(ValueError, match="no documents"):
        pack_documents([], BYTES)


def test_text_and_jsonl_sources_from_file_folder_and_glob(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.txt").write_text("first file\nstill first")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"latin-1 \xe9 byte")
    records = [{"text": "one", "id": 1}, {"text": "two\u2028still two"}, {"text": "three"}]
    lines = [json.dumps(record, ensure_ascii=False) for record in records]
    (tmp_path / "sub" / "c.jsonl").write_text("\n".join([lines[0], "", lines[1], lines[2], ""]))
    (tmp_path / "notes.md").write_text("not data")

    files = source_files(str(tmp_path))
    assert [file.name for file in files] == ["a.txt", "b.txt", "bad.txt", "empty.txt", "c.jsonl"]
    documents = list(iter_documents(files))
    assert documents == [
        "first file\nstill first",
        "second file",
        "latin-1 \ufffd byte",  # undecodable bytes become U+FFFD, the file is kept
        "one",
        "two\u2028still two",
        "three",
    ]
    assert source_files(str(tmp_path / "a.txt")) == [tmp_path / "a.txt"]
    glob_files = source_files(str(tmp_path / "**" / "*.jsonl"))
    assert glob_files == [tmp_path / "sub" / "c.jsonl"]
    with pytest.raises(ValueError, match=r"notes\.md.*not one of"):
        source_files(str(tmp_path / "*.md"))


def test_jsonl_field_is_configurable_and_bad_lines_name_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"body": "x"}\n{"body": "y"}\n')
    assert list(iter_documents([path], jsonl_field="body")) == ["x", "y"]
    with pytest.raises(ValueError, match=rf"{path}:1: no field 'text'.*data\.jsonl_field"):
        list(iter_documents([path]))
    path.write_text('{"text": "ok"}\n{"text": "broken\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
        list(iter_documents([path]))
    path.write_text('{"text": "ok"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}:3: a JSON array, not an object"):
        list(iter_documents([path]))
    path.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=rf"{path}:1: field 'text' holds a JSON number"):
        list(iter_documents([path]))


def test_missing_sources_name_the_pattern(tmp_path):
    pattern = str(tmp_path / "nothing" / "*.jsonl")
    with pytest.raises(ValueError, match=r"glob matches no files") as error:
        source_files(pattern)
    assert pattern in str(error.value)
    with pytest.raises(ValueError, match="no such file or folder"):
        source_files(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="folder without"):
        source_files(str(tmp_path))


def _loader(stream, **overrides) -> PackedDataLoader:
    options = dict(seq_len=8, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=3)
    return PackedDataLoader(stream, **{**options, **overrides})


def test_dp_shards_concatenate_to_the_same_global_batch():
    stream = pack_documents(_texts(40, seed=2), BYTES)
    single = _loader(stream)
    pairs = [_loader(stream, local_batch_size=2, dp_rank=rank, dp_world_size=2) for rank in (0, 1)]
    quads = [
        _loader(stream, local_batch_size=1, dp_rank=rank, dp_world_size=4) for rank in range(4)
    ]
    steps = 2 * single.steps_per_epoch + 3  # across two epoch boundaries
    for _ in range(steps):
        expected = next(single)
        assert (expected == torch.cat([next(loader) for loader in pairs], dim=0)).all()
        assert (expected == torch.cat([next(loader) for loader in quads], dim=0)).all()


def test_epoch_visits_distinct_rows_in_a_seeded_order():
    stream = pack_documents(_texts(40, seed=2), BYTES)
    loader = _loader(stream, local_batch_size=1)
    order = loader._epoch_order(0).clone()
    assert sorted(order.tolist()) == list(range(loader.num_rows))
    assert torch.equal(order, _loader(stream, local_batch_size=1)._epoch_order(0))
    assert not torch.equal(order, _loader(stream, seed=4)._epoch_order(0))
    assert not torch.equal(order, loader._epoch_order(1))
    unshuffled = _loader(stream, local_batch_size=1, shuffle=False)
    first = next(unshuffled)
    assert torch.equal(first["tokens"], stream.rows(torch.tensor([0]), 8)["tokens"])


def test_resumed_loader_continues_exactly_where_it_stopped():
    stream = pack_documents(_texts(40, seed=5), BYTES)
    original = _loader(stream, local_batch_size=3)
    for _ in range(original.steps_per_epoch - 2):
        next(original)
    state = original.state_dict()
    expected = [next(original) for _ in range(6)]  # crosses into the next epoch
    assert original.epoch == 1
    for dp_world_size in (1, 3):  # the state is global: another dp degree resumes it too
        resumed = [
            _loader(stream, local_batch_size=3 // dp_world_size, dp_rank=rank,
                    dp_world_size=dp_world_size)
            for rank in range(dp_world_size)
        ]  # fmt: skip
        for loader in resumed:
            loader.load_state_dict(dict(state))
        for batch in expected:
            assert (batch == torch.cat([next(loader) for loader in resumed], dim=0)).all()
    fresh = _loader(stream, local_batch_size=3)
    assert not (next(fresh) == expected[0]).all()
    at_the_end = {**state, "position": original.steps_per_epoch * 3}  # an epoch not yet rolled
    rolled = _loader(stream, local_batch_size=3)
    rolled.load_state_dict(at_the_end)
    assert (rolled.epoch, rolled.position) == (1, 0)
    with pytest.raises(ValueError, match="seed=3, this loader has seed=9"):
        _loader(stream, local_batch_size=3, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows"):
        _loader(stream, seq_len=9, local_batch_size=3).load_state_dict(state)


def test_loader_workers_give_the_serial_batches_and_resume_at_a_saved_position():
    stream = pack_documents(_texts(40, seed=5), BYTES)
    serial = _loader(stream, local_batch_size=3)
    steps = serial.steps_per_epoch + 3  # across an epoch boundary
    expected = [next(serial) for _ in range(steps)]
    with_workers = _loader(stream, local_batch_size=3, num_workers=2, prefetch_factor=2)
    taken = [next(with_workers) for _ in range(4)]  # the workers run ahead of this
    state = with_workers.state_dict()
    taken += [next(with_workers) for _ in range(steps - 4)]
    for batch, reference in zip(taken, expected, strict=True):
        assert (batch == reference).all()
    resumed = _loader(stream, local_batch_size=3, num_workers=2)
    next(resumed)  # workers started at step 0 ...
    resumed.load_state_dict(state)  # ... are replaced by workers at step 4
    for reference in expected[4:]:
        assert (next(resumed) == reference).all()


def test_loader_rejects_bad_batch_arguments():
    stream = pack_documents(["tiny"], BYTES)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _loader(stream)
    with pytest.raises(ValueError, match="dp_rank=2 must lie in"):
        _loader(stream, dp_rank=2, dp_world_size=2)


def test_build_data_loader_from_jsonl_config_and_memory_cache(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"content": text}) for text in _texts(60)))
    config = DataConfig(source=str(path), jsonl_field="content", shuffle=False)
    options = dict(seq_len=16, local_batch_size=2, dp_rank=1, dp_world_size=2, seed=0)
    loader = build_data_loader(config, **options)
    batch = next(loader)
    assert batch.batch_size == torch.Size([2, 16])
    assert set(batch.keys()) == {"tokens", "labels", "positions", "document_ids"}
    unshuffled_rows = loader.stream.rows(torch.tensor([2, 3]), 16)  # rank 1 of dp 2, step 0
    assert (batch == unshuffled_rows).all()
    assert build_data_loader(config, **options).stream is loader.stream  # tokenized once
    path.write_text(path.read_text() + "\n" + json.dumps({"content": "one more document"}))
    assert load_token_stream(config) is not loader.stream  # a changed file is re-read
    with pytest.raises(ValueError, match="dp_rank=2"):
        build_data_loader(config, **{**options, "dp_rank": 2})


def test_stdlib_corpus_is_nonempty_sorted_and_deterministic():
    files = stdlib_files()
    assert len(files) > 500 and files == stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [file.relative_to(root).as_posix() for file in files]
    assert relative == sorted(relative) and all(file.suffix == ".py" for file in files)
    assert not any("site-packages" in path or "dist-packages" in path for path in relative)
    start = time.perf_counter()
    loader = build_data_loader(
        DataConfig(), seq_len=256, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0
    )
    seconds = time.perf_counter() - start
    stream = loader.stream
    assert stream.num_documents > 500 and stream.num_tokens > 10_000_000
    assert int(stream.tokens_T.max()) < BYTES.vocab_size
    print(f"stdlib: {len(files)} files, {stream.num_tokens} tokens, loader built in {seconds:.2f}s")
    batch = next(loader)
    assert batch["tokens"].shape == (2, 256) and int(batch["tokens"].max()) < 258


def test_hf_tokenizer_json_encodes_without_its_post_processor(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", LLAMA3_BOS, LLAMA3_EOS])
    tokenizer.train_from_iterator(["hello world", "hello pipekit world"], trainer)
    bos_id = tokenizer.token_to_id(LLAMA3_BOS)
    # Llama 3's tokenizer.json prepends BOS itself; packing must not get it twice
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A", special_tokens=[(LLAMA3_BOS, bos_id)]
    )
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    hf = build_tokenizer(str(path))
    assert isinstance(hf, HFTokenizer) and build_tokenizer(str(tmp_path)).path == path
    vocab = tokenizer.get_vocab()
    assert hf.encode("hello pipekit world") == [vocab[w] for w in ("hello", "pipekit", "world")]
    assert (hf.bos_id, hf.eos_id, hf.vocab_size) == (bos_id, vocab[LLAMA3_EOS], len(vocab))
    assert hf.decode(hf.encode("hello world")) == "hello world"
    stream = pack_documents(["hello world", "world"], hf)
    expected = [bos_id, vocab["hello"], vocab["world"], hf.eos_id, bos_id, vocab["world"]]
    assert stream.tokens_T.tolist() == [*expected, hf.eos_id]

    plain = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match=r"no BOS token '<\|begin_of_text\|>'"):
        build_tokenizer(str(tmp_path / "plain.json"))


def test_tokenizer_spec_errors_name_the_fix(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match="no such file") as error:
        build_tokenizer(str(missing))
    assert str(missing) in str(error.value) and '"bytes"' in str(error.value)
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'pipekit\[hf\]'"):
        build_tokenizer(str(path))


def _word_tokenizer(tmp_path) -> Path:
    """A word-level tokenizer.json of 12 ids with Llama 3's BOS/EOS tokens."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", LLAMA3_BOS, LLAMA3_EOS])
    words = ["the", "pipeline", "trains", "a", "small", "model", "on", "real", "words"]
    tokenizer.train_from_iterator([" ".join(words)], trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_debug_flavors_take_the_tokenizers_vocabulary_or_the_override(tmp_path):
    tokenizer = _word_tokenizer(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the pipeline trains a small model on real words"] * 200))
    argv = [
        "--config", "configs/debug_model.toml", "--data.source", str(corpus),
        "--data.tokenizer", str(tokenizer), "--job.output_dir", str(tmp_path / "out"),
        "--training.steps", "2", "--training.seq_len", "32", "--training.global_batch_size", "2",
        "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "false",
        "--metrics.peak_flops", "1e9", "--parallelism.dp_shard", "1",
    ]  # fmt: skip
    job = validate_job(load_job_config(argv), world_size=1)
    assert job.shape.vocab_size == 12
    trainer = Trainer(job)
    embedding = getattr(trainer.model, job.spec.structure.embedding)
    assert embedding.weight.shape[0] == 12
    losses = trainer.train()
    assert losses[0] == pytest.approx(math.log(12), abs=0.5)  # about uniform over 12 ids
    override = validate_job(load_job_config([*argv, "--model.vocab_size", "64"]), world_size=1)
    assert override.shape.vocab_size == 64
    with pytest.raises(ConfigError, match=r"has 12 ids .* set \[model\] vocab_size >= 12"):
        validate_job(load_job_config([*argv, "--model.vocab_size", "8"]), world_size=1)
    sized = validate_job(load_job_config([*argv, "--model.flavor", "1B"]), world_size=1)
    assert sized.shape.vocab_size == 128256  # a published flavor keeps its vocabulary
    with pytest.raises(ConfigError, match="vocab_size=-1 must be >= 0"):
        validate_job(load_job_config([*argv, "--model.vocab_size", "-1"]), world_size=1)


def test_hf_datasets_source_reads_local_parquet_and_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(30, seed=7)
    pq.write_table(pa.table({"body": texts[:20], "n": list(range(20))}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"body": texts[20:], "n": list(range(10))}), tmp_path / "b.parquet")
    parquet = DataConfig(
        source="hf", hf_path="parquet", hf_data_files=str(tmp_path / "*.parquet"),
        jsonl_field="body",
    )  # fmt: skip
    expected = pack_documents(texts, BYTES)
    stream = load_token_stream(parquet)
    assert torch.equal(stream.tokens_T, expected.tokens_T)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts))
    jsonl = DataConfig(
        source="hf", hf_path="json", hf_data_files=str(tmp_path / "c.jsonl"), jsonl_field="body"
    )
    assert torch.equal(load_token_stream(jsonl).tokens_T, expected.tokens_T)
    assert check_data_config(parquet) == BYTES.vocab_size

    with pytest.raises(ValueError, match=r"no column 'text' \(its columns: body, n\)"):
        load_token_stream(DataConfig(**{**vars(parquet), "jsonl_field": "text"}))
    with pytest.raises(ValueError, match=r"column 'n' holds a int, not text"):
        load_token_stream(DataConfig(**{**vars(parquet), "jsonl_field": "n"}))
    with pytest.raises(ValueError, match="matches no file"):
        check_data_config(DataConfig(**{**vars(parquet), "hf_data_files": str(tmp_path / "x*")}))
    with pytest.raises(ValueError, match="needs hf_path"):
        check_data_config(DataConfig(source="hf"))


@pytest.mark.parametrize("streaming", [False, True], ids=["in_memory", "streamed"])
def test_hf_datasets_bad_files_are_one_line_naming_file_and_line(tmp_path, streaming):
    """A corrupt JSON line read through `datasets` is named `file:line` (1-based) as the local
    reader names it; an empty file is named too; neither is a traceback of datasets'."""
    lines = [json.dumps({"text": f"document {index}"}) for index in range(80)]
    lines[56] = '{"text": "torn'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    for name, message in (
        ("bad.jsonl", r"bad\.jsonl:57: not valid JSON"),
        ("empty.jsonl", r"could not be read \(empty files: .*empty\.jsonl\)"),
    ):
        config = DataConfig(
            source="hf", hf_path="json", hf_data_files=str(tmp_path / name), shuffle=False,
            streaming=streaming,
        )  # fmt: skip
        with pytest.raises(ValueError, match=message) as error:
            if streaming:
                next(_streaming_loader(config))
            else:
                load_token_stream(config)
        assert type(error.value) is ValueError and "\n" not in str(error.value)


@pytest.mark.parametrize("streaming", [False, True], ids=["in_memory", "streamed"])
def test_hf_datasets_rows_restart_positions_where_a_row_continues_a_document(tmp_path, streaming):
    texts = _texts(200, seed=13)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    config = DataConfig(
        source="hf", hf_path="json", hf_data_files=str(tmp_path / "c.jsonl"), streaming=streaming
    )
    batch = next(_streaming_loader(config, local_batch_size=16))
    assert_positions_restart_per_row(batch, 16, BYTES.bos_id)


def _streaming_loader(config, **overrides):
    options = dict(seq_len=16, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=3)
    return build_data_loader(config, **{**options, **overrides})


def test_streamed_rows_equal_the_packed_corpus_and_resume_by_re_reading(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(400, seed=11)
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet")
    source = dict(source="hf", hf_path="parquet", hf_data_files=str(tmp_path / "*.parquet"))
    in_memory = _loader(pack_documents(texts, BYTES), seq_len=16, shuffle=False)
    streamed = _streaming_loader(DataConfig(**source, streaming=True, shuffle=False))
    steps = in_memory.steps_per_epoch + 2  # into the second epoch
    expected = [next(in_memory) for _ in range(steps)]
    for batch in expected:
        assert (next(streamed) == batch).all()
    assert streamed.epoch == 1

    shuffled = DataConfig(**source, streaming=True, shuffle_buffer=50)
    reference = _streaming_loader(shuffled)
    batches = [next(reference) for _ in range(5)]
    assert not all((a == b).all() for a, b in zip(batches, expected, strict=False))
    halves = [_streaming_loader(shuffled, local_batch_size=2, dp_rank=r, dp_world_size=2)
              for r in (0, 1)]  # fmt: skip
    for _ in range(2):
        state = halves[0].state_dict()
        [next(half) for half in halves]
    resumed = [_streaming_loader(shuffled, local_batch_size=2, dp_rank=r, dp_world_size=2)
               for r in (0, 1)]  # fmt: skip
    for loader in resumed:
        loader.load_state_dict(dict(state))  # saved after step 1: re-reads one global batch
    for batch in batches[1:]:
        assert (batch == torch.cat([next(loader) for loader in resumed], dim=0)).all()
    with pytest.raises(ValueError, match="set source = 'hf' or streaming = false"):
        check_data_config(DataConfig(streaming=True))
    with pytest.raises(ValueError, match="set num_workers = 0"):
        check_data_config(DataConfig(**source, streaming=True, num_workers=2))


def _write_corpus(path: Path, marker: str, count: int) -> None:
    """A JSONL corpus whose every document is `marker` repeated (so a row's source shows)."""
    path.write_text(
        "".join(json.dumps({"text": marker * (10 + i % 7)}) + "\n" for i in range(count))
    )


def test_mixed_sources_take_their_weights_deterministically_and_resume_exactly(tmp_path):
    """Two corpora of 120 and 30 documents mixed 1:3 (the small one upsampled): every epoch
    holds their rows in those shares; the same seed gives the same batches; a loader restored
    from the state saved after step 3 gives exactly the batches that followed, with 2 data
    ranks in place of 1; other weights are refused on resume; bad mixtures are one line."""
    _write_corpus(tmp_path / "a.jsonl", "a", 120)
    _write_corpus(tmp_path / "b.jsonl", "b", 30)
    mix = DataConfig(mix_sources=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                     mix_weights=[1.0, 3.0])  # fmt: skip
    options = dict(seq_len=16, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=5)
    loader = build_data_loader(mix, **options)
    rows = [loader.stream.rows(torch.tensor([n]), 16)["tokens"][0] for n in range(loader.num_rows)]
    from_b = sum(int((row == ord("b")).any()) for row in rows)
    assert from_b == round(loader.num_rows * 3 / 4)  # the weights, whatever the corpus sizes
    batches = [next(loader) for _ in range(8)]
    again = build_data_loader(mix, **options)
    assert all((next(again) == batch).all() for batch in batches)
    state = build_data_loader(mix, **options)
    [next(state) for _ in range(3)]
    saved = state.state_dict()
    halves = [build_data_loader(mix, **{**options, "local_batch_size": 2, "dp_rank": rank,
                                        "dp_world_size": 2}) for rank in (0, 1)]  # fmt: skip
    for half in halves:
        half.load_state_dict(dict(saved))
    for batch in batches[3:]:
        assert (batch == torch.cat([next(half) for half in halves])).all()
    other = build_data_loader(dataclasses.replace(mix, mix_weights=[1.0, 1.0]), **options)
    with pytest.raises(ValueError, match="saved with mixture="):
        other.load_state_dict(dict(saved))
    for bad, message in (
        ({"mix_weights": [1.0]}, "mix_sources has 2 entries and mix_weights 1"),
        ({"mix_weights": [1.0, 0.0]}, r"must all be positive"),
        ({"mix_sources": [str(tmp_path / "a.jsonl"), "/no/such/*.jsonl"]}, r"mix_sources\[1\]"),
        ({"source": str(tmp_path / "a.jsonl")}, "mix_sources replaces source"),
    ):
        with pytest.raises(ValueError, match=message):
            check_data_config(dataclasses.replace(mix, **bad))
