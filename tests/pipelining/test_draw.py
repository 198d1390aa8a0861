"""Pictures and traces of pipeline timelines: the SVG has one box per action and one row per
rank, the Chrome/Perfetto trace one event per action, PNG goes through matplotlib (and says how to
get it when missing), torch's schedules yield valid action lists without a process group, and the
recorder of an executed step sees exactly the schedule's actions, in its order, on every rank."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from tiny_models import TINY_LLAMA, pp_mesh, tiny_pipeline

from pipekit.config import ConfigError, load_job_config
from pipekit.layers.loss import count_label_tokens
from pipekit.pipelining.actions import Action, ComputationType, validate_actions
from pipekit.pipelining.schedules.events import ScheduledAction
from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions
from pipekit.pipelining.tools.draw import main, save_timeline, timeline_svg
from pipekit.pipelining.tools.timeline import chrome_trace
from pipekit.pipelining.tools.trace import gather_timeline, record_pipeline_step, record_schedule
from pipekit.testing import run_on_ranks
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

SVG = "{http://www.w3.org/2000/svg}"
F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
INPUT_GRAD, WEIGHT_GRAD = ComputationType.BACKWARD_INPUT, ComputationType.BACKWARD_WEIGHT


def _back_to_back(actions_by_rank: dict[int, list[Action]]) -> list[ScheduledAction]:
    """A timeline with each rank starting at `rank` and one idle unit after every third action:
    not a real schedule, just boxes with gaps."""
    events = []
    for rank, actions in actions_by_rank.items():
        time = float(rank)
        for index, action in enumerate(actions):
            duration = 1.0 if action.computation_type == F else 2.0
            events.append(ScheduledAction(rank, action, time, time + duration))
            time += duration + (1.0 if index % 3 == 2 else 0.0)
    return events


def _sliced_events() -> list[ScheduledAction]:
    return _back_to_back(sliced_pipeline_actions(2, 2, 4))  # 2 ranks x 16 actions


def test_svg_is_well_formed_with_one_box_per_action_and_one_row_per_rank() -> None:
    events = _sliced_events()
    root = ElementTree.fromstring(timeline_svg(events, num_slices=4, title="sliced p=2"))
    rects = root.iter(f"{SVG}rect")
    classes = Counter(rect.get("class") for rect in rects)
    assert classes["action"] == len(events) == 32
    assert classes["row"] == 2
    texts = [text.text for text in root.iter(f"{SVG}text")]
    assert {"rank 0", "rank 1", "sliced p=2", "mb 0", "mb 1", "forward", "backward"} <= set(texts)
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "label"]
    assert sorted(set(labels)) == ["0", "1", "2", "3"]  # slice indices
    tooltips = {title.text for title in root.iter(f"{SVG}title")}
    assert "F mb1 s3 (stage 0)" in tooltips and "B mb0 s2 (stage 1)" in tooltips


def test_svg_leaves_idle_time_blank_and_colours_by_microbatch() -> None:
    events = _sliced_events()
    root = ElementTree.fromstring(timeline_svg(events, num_slices=4))
    boxes = [rect for rect in root.iter(f"{SVG}rect") if rect.get("class") == "action"]
    rank0 = sorted(
        (float(b.get("x")), float(b.get("width")), b.get("fill"))
        for b in boxes
        if b.get("y") == boxes[0].get("y")
    )
    gaps = [nxt[0] - (x + width) for (x, width, _), nxt in itertools.pairwise(rank0)]
    assert min(gaps) > -1e-6 and max(gaps) > 10  # no overlap; the idle units show as gaps
    forward_fills = {
        (event.microbatch_and_slice(4)[0], box.get("fill"))
        for event, box in zip(events, boxes, strict=True)
        if event.kind == "F"
    }
    assert len(forward_fills) == 2  # one shade per microbatch, whatever the slice


def test_unsliced_boxes_are_labelled_with_their_microbatch() -> None:
    events = _back_to_back(torch_schedule_actions("1F1B", 2, 3))
    root = ElementTree.fromstring(timeline_svg(events))
    labels = {t.text for t in root.iter(f"{SVG}text") if t.get("class") == "label"}
    assert labels == {"0", "1", "2"}


def test_chrome_trace_has_one_event_per_action_and_one_process_per_rank(tmp_path: Path) -> None:
    events = _sliced_events()
    path = tmp_path / "trace.json"
    save_timeline(events, path, num_slices=4, time_unit_s=1e-3)
    trace = json.loads(path.read_text())
    complete = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    names = {
        event["pid"]: event["args"]["name"]
        for event in trace["traceEvents"]
        if event["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1"}
    assert len(complete) == len(events)
    assert Counter(event["pid"] for event in complete) == {0: 16, 1: 16}
    by_key = {(e.rank, e.start): e for e in events}
    for event in complete:
        source = by_key[(event["pid"], event["ts"] / 1e3)]
        assert event["dur"] == pytest.approx((source.end - source.start) * 1e3)
        assert event["name"] == source.label(4)
        assert event["args"]["kind"] == source.kind
    first = next(e for e in complete if e["pid"] == 0 and e["args"]["unit"] == 7)
    assert first["name"] == "F mb1 s3 (stage 0)"
    assert first["args"] == {"stage": 0, "microbatch": 1, "slice": 3, "unit": 7, "kind": "F"}
    assert chrome_trace(events)["traceEvents"][-1]["name"].startswith("B mb")


def test_png_is_written_by_matplotlib(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    save_timeline(_back_to_back(torch_schedule_actions("ZBVZeroBubble", 2, 4, 2)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'pipekit\[viz\]'"):
        save_timeline(_sliced_events(), tmp_path / "timeline.png", num_slices=4)


def test_svg_and_trace_need_no_matplotlib() -> None:
    code = (
        "import sys; import pipekit.pipelining.tools.draw, pipekit.pipelining.tools.trace; "
        "assert 'matplotlib' not in sys.modules, 'imported matplotlib'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.svg, \.png or \.json"):
        save_timeline(_sliced_events(), tmp_path / "timeline.pdf", num_slices=4)


@pytest.mark.parametrize(
    ("name", "stages_per_rank", "placement"),
    [
        ("GPipe", 1, "loop"),
        ("1F1B", 1, "loop"),
        ("Interleaved1F1B", 2, "loop"),
        ("LoopedBFS", 2, "loop"),
        ("InterleavedZeroBubble", 2, "loop"),
        ("ZBVZeroBubble", 2, "v"),
        ("DualPipeV", 2, "v"),
    ],
)
@pytest.mark.parametrize(("num_ranks", "num_microbatches"), [(2, 4), (4, 8)])
def test_torch_schedule_actions_run_every_unit_once_forward_and_once_backward(
    name: str, stages_per_rank: int, placement: str, num_ranks: int, num_microbatches: int
) -> None:
    actions = torch_schedule_actions(name, num_ranks, num_microbatches, stages_per_rank)
    num_stages = num_ranks * stages_per_rank
    stage_to_rank = validate_actions(actions, num_ranks, num_stages, num_microbatches)
    if placement == "loop":
        assert stage_to_rank == {stage: stage % num_ranks for stage in range(num_stages)}
    else:
        assert stage_to_rank == {s: min(s, num_stages - 1 - s) for s in range(num_stages)}
    counts = Counter(action for rank_actions in actions.values() for action in rank_actions)
    assert set(counts.values()) == {1}
    for stage in range(num_stages):
        for microbatch in range(num_microbatches):
            kinds = {
                kind
                for kind in (F, B, INPUT_GRAD, WEIGHT_GRAD)
                if Action(stage, kind, microbatch) in counts
            }
            assert kinds in ({F, B}, {F, INPUT_GRAD, WEIGHT_GRAD}), (stage, microbatch, kinds)


def test_the_registry_refuses_a_wrong_shape_before_any_list_is_made() -> None:
    with pytest.raises(ValueError, match="set stages_per_rank=1"):
        get_schedule("1F1B").check(ScheduleShape(2, 4, stages_per_rank=2))
    with pytest.raises(ValueError, match="set stages_per_rank=2"):
        get_schedule("ZBVZeroBubble").check(ScheduleShape(2, 4, stages_per_rank=1))
    with pytest.raises(ValueError, match="'GPipe' cannot carry context_exchange"):
        get_schedule("GPipe").check(ScheduleShape(2, 4), sliced_only=["context_exchange"])
    with pytest.raises(ValueError, match="pipeline_schedule='sliced2' is not known"):
        get_schedule("sliced2")


def test_cli_draws_a_simulated_schedule_and_a_user_csv(tmp_path: Path, capsys) -> None:
    svg = tmp_path / "sliced.svg"
    main([
        "--schedule", "sliced", "--pp", "2", "--microbatches", "2", "--slices", "4",
        "--attention-share", "0.5", "--out", str(svg),
    ])  # fmt: skip
    root = ElementTree.fromstring(svg.read_text())
    assert sum(rect.get("class") == "action" for rect in root.iter(f"{SVG}rect")) == 32
    assert "makespan" in capsys.readouterr().out
    csv_path = tmp_path / "user.csv"
    csv_path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    trace = tmp_path / "user.json"
    main(["--actions-csv", str(csv_path), "--pp", "2", "--out", str(trace)])
    complete = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 8


def test_cli_draws_equal_cost_slices_with_a_shorter_makespan(tmp_path: Path, capsys) -> None:
    """Attention 70% of the work: equal-cost slices give the sliced schedule a shorter makespan
    than equal-length ones, the same 32 actions."""
    makespans = {}
    for slicing in ("equal_length", "equal_cost"):
        svg = tmp_path / f"{slicing}.svg"
        main([
            "--schedule", "sliced", "--pp", "2", "--microbatches", "2", "--slices", "4",
            "--attention-share", "0.7", "--slicing", slicing, "--out", str(svg),
        ])  # fmt: skip
        root = ElementTree.fromstring(svg.read_text())
        assert sum(rect.get("class") == "action" for rect in root.iter(f"{SVG}rect")) == 32
        printed = capsys.readouterr().out
        makespans[slicing] = float(printed.split("makespan ")[1].split(",")[0])
    assert "equal-cost slices" in printed
    assert makespans["equal_cost"] < 0.95 * makespans["equal_length"], makespans


def test_cli_prices_packed_documents_and_cuts_each_microbatch_by_them(tmp_path, capsys) -> None:
    """Rows of short documents (log-normal, median 256 tokens, in 8K rows): far less attention
    than causal rows, and a sliced schedule whose slices are cut by each microbatch's documents
    finishes before equal-length and causal equal-cost cuts of the same rows."""
    makespans = {}
    shape = ["--schedule", "sliced", "--pp", "2", "--microbatches", "4", "--slices", "8"]
    for slicing, lengths in [
        ("equal_cost", ""), ("equal_length", "lognormal:median=256,sigma=1.0"),
        ("equal_cost", "lognormal:median=256,sigma=1.0"),
        ("documents", "lognormal:median=256,sigma=1.0"),
    ]:  # fmt: skip
        main([*shape, "--attention-share", "0.7", "--slicing", slicing,
              "--document-lengths", lengths, "--out", str(tmp_path / "t.svg")])  # fmt: skip
        printed = capsys.readouterr().out
        makespans[slicing, bool(lengths)] = float(printed.split("makespan ")[1].split(",")[0])
    assert "slices cut by documents, log-normal document lengths, median 256" in printed
    packed = {slicing: makespans[slicing, True] for slicing, _ in makespans if _}
    assert packed["documents"] < min(packed["equal_length"], packed["equal_cost"]), packed
    assert packed["equal_cost"] < 0.6 * makespans["equal_cost", False]
    with pytest.raises(ValueError, match="give --document-lengths"):
        main([*shape, "--slicing", "documents", "--out", str(tmp_path / "t.svg")])


# --- recording an executed step ------------------------------------------------------------------

BATCH, SEQ_LEN = 4, 16


def _batch() -> TensorDict:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY_LLAMA.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    positions = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    return TensorDict(
        tokens=tokens,
        labels=tokens.roll(-1, dims=1),
        positions=positions,
        document_ids=torch.zeros_like(tokens),
        batch_size=[BATCH, SEQ_LEN],
    )


def _runner(rank: int, world: int, schedule: str, v: int, m: int, n: int):
    return tiny_pipeline(
        pp_mesh(world),
        schedule=schedule,
        stages_per_rank=v,
        microbatches=m,
        num_slices=n,
        rows=BATCH,
        seq_len=SEQ_LEN,
        dtype=torch.float32,
        seed=0,
    )


def _record(rank: int, world: int, configs: list[tuple], output_dir: Path) -> list:
    results = []
    batch = _batch()
    for config in configs:
        runner = _runner(rank, world, *config)
        with record_schedule(runner) as recorder:
            runner.step(batch, count_label_tokens(batch["labels"]))
        observed = [s.stage_index for s in runner.stages if s.action_observer is not None]
        results.append((gather_timeline(recorder), observed))
    runner = _runner(rank, world, "sliced", 1, 2, 2)
    with record_pipeline_step(runner, output_dir, enabled=True, write=rank == 0):
        runner.step(batch, count_label_tokens(batch["labels"]))
    dist.barrier()
    return results


def test_recorded_step_has_each_scheduled_action_once_in_schedule_order(tmp_path: Path) -> None:
    configs = [("sliced", 1, 2, 2), ("sliced", 2, 1, 2), ("1F1B", 1, 2, 1)]
    configs += [("GPipe", 1, 2, 1), ("ZBVZeroBubble", 2, 2, 1)]
    per_rank = run_on_ranks(_record, 2, configs, tmp_path, timeout=180)
    for index, (schedule, v, m, n) in enumerate(configs):
        timeline, observed = per_rank[0][index]
        assert per_rank[1][index][0] == timeline  # gathered on every rank
        assert observed == [] and per_rank[1][index][1] == []  # no observer after the block
        if schedule == "sliced":
            expected = sliced_pipeline_actions(2, m, n, v)
        else:
            expected = torch_schedule_actions(schedule, 2, m, v)
        for rank in (0, 1):
            events = [event for event in timeline if event.rank == rank]
            assert [event.action for event in events] == expected[rank], (schedule, rank)
            assert all(0 <= event.start < event.end for event in events)
            assert all(a.end <= b.start for a, b in itertools.pairwise(events))
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    assert sum(event["ph"] == "X" for event in trace["traceEvents"]) == 2 * 2 * 4
    ElementTree.parse(tmp_path / "pipeline_trace.svg")


def _train_with_trace(rank: int, world: int, output_dir: Path) -> None:
    config = load_job_config(
        [
            "--config", "configs/debug_sliced_pp.toml", "--job.output_dir", str(output_dir),
            "--training.steps", "2", "--training.global_batch_size", "2",
            "--training.seq_len", "16", "--lr_scheduler.warmup_steps", "1",
            "--parallelism.microbatches", "2", "--parallelism.num_slices", "2",
            "--checkpoint.enable", "false", "--checkpoint.resume", "false",
            "--metrics.peak_flops", "1e9", "--metrics.pipeline_trace_step", "2",
        ]
    )  # fmt: skip
    Trainer(validate_job(config, world_size=world)).train()


def test_trainer_writes_the_timeline_of_the_chosen_step(tmp_path: Path) -> None:
    run_on_ranks(_train_with_trace, 2, tmp_path, timeout=180)
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    complete = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert Counter(event["pid"] for event in complete) == {0: 8, 1: 8}
    ElementTree.parse(tmp_path / "pipeline_trace.svg")


def test_trace_step_without_a_pipeline_is_refused(tmp_path: Path) -> None:
    config = load_job_config(
        ["--config", "configs/debug_model.toml", "--metrics.pipeline_trace_step", "1"]
    )
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=1"):
        validate_job(config, world_size=1)
