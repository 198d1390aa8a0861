"""User-defined schedules: both file formats parse (and name the file, rank and position of a bad
entry), every check rule is caught with its message, a deadlock is found before running with the
rank and the action that waits, and a user schedule that spells out 1F1B (from Task objects and
from configs/schedules/1f1b_p2_m4.csv) gives torch's Schedule1F1B's loss and gradients in float64,
as do ZB-H1 (I/W) and the sliced example. The ablation runs a sliced schedule the check rejects
without the check: it fails only inside the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import PARITY_SEQ_LEN, pp_mesh, tiny_batch, tiny_pipeline

from pipekit.config.job_config import JobConfig, ParallelismConfig
from pipekit.config.loader import ConfigError
from pipekit.layers.loss import token_sum_cross_entropy
from pipekit.models import get_model_spec
from pipekit.pipelining._torch_runtime import PipelineScheduleRuntime
from pipekit.pipelining.actions import Action
from pipekit.pipelining.plan import plan_pipeline
from pipekit.pipelining.schedules.check import ScheduleError, check_schedule
from pipekit.pipelining.schedules.simulate import ScheduleDeadlockError
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.user import Task, load_schedule_file, tasks_to_actions
from pipekit.testing import RankFailedError, max_relative_difference, run_on_ranks, runner_step
from pipekit.train.job import validate_job

SCHEDULES = Path(__file__).resolve().parents[2] / "configs" / "schedules"
ONE_F_ONE_B_CSV = SCHEDULES / "1f1b_p2_m4.csv"
SLICED_TOML = SCHEDULES / "sliced_p2_m2_n4.toml"
ROWS = 4  # sequences per batch: 4 microbatches of one row, or 2 of two
PARITY = 1e-12


def _one_f_one_b(num_ranks: int, num_microbatches: int) -> list[list[Task]]:
    """1F1B with one stage per rank: rank r runs p - r forwards, then alternates B and F."""
    by_rank = []
    for rank in range(num_ranks):
        forwards = [Task(rank, mb, "F") for mb in range(num_microbatches)]
        backwards = [Task(rank, mb, "B") for mb in range(num_microbatches)]
        warmup = min(num_microbatches, num_ranks - rank)
        tasks = forwards[:warmup]
        for index, backward in enumerate(backwards):
            tasks += [backward, *forwards[warmup + index : warmup + index + 1]]
        by_rank.append(tasks)
    return by_rank


def _zero_bubble_h1() -> list[list[Task]]:
    """ZB-H1 (p = 2, m = 4): backwards split into I and W, each W delayed into a bubble."""
    rows = ["F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3", "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"]
    return [
        [Task(rank, int(cell[1:]), cell[0]) for cell in row.split()]
        for rank, row in enumerate(rows)
    ]


def _backward_slices_ascending(
    actions_by_rank: dict[int, list[Action]], num_slices: int
) -> dict[int, list[Action]]:
    """The same lists with each microbatch's backwards in increasing slice order."""

    def mirrored(action: Action) -> Action:
        if action.computation_type.value != "B":
            return action
        microbatch, slice_index = divmod(action.microbatch_index, num_slices)
        unit = microbatch * num_slices + num_slices - 1 - slice_index
        return Action(action.stage_index, action.computation_type, unit)

    return {rank: [mirrored(a) for a in actions] for rank, actions in actions_by_rank.items()}


def _v_shaped_gpipe(num_microbatches: int) -> list[list[Task]]:
    """GPipe over 4 stages in a V on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1, 2."""
    microbatches = range(num_microbatches)

    def run(stage: int, kind: str) -> list[Task]:
        return [Task(stage, mb, kind) for mb in microbatches]

    return [
        run(0, "F") + run(3, "F") + run(3, "B") + run(0, "B"),
        run(1, "F") + run(2, "F") + run(2, "B") + run(1, "B"),
    ]


def _parse(rows: list[str]) -> dict[int, list[Action]]:
    return {rank: [Action.from_str(cell) for cell in row.split()] for rank, row in enumerate(rows)}


# -- formats ---------------------------------------------------------------------------------


def test_tasks_round_trip_through_text_and_number_units_by_slice():
    task = Task(stage=1, microbatch=2, kind="B", slice=3)
    assert Task.parse(str(task)) == task == Task.parse("B slice=3 mb=2 stage=1")
    assert task.to_action(num_slices=4) == Action.from_str("1B11")
    assert tasks_to_actions([[Task(0, 1, "F")]], num_slices=2) == {0: [Action.from_str("0F2")]}
    with pytest.raises(ValueError, match="slice=3 must be below num_slices=2"):
        task.to_action(num_slices=2)
    with pytest.raises(ValueError, match="kind='X' is not one of F, B, I, W"):
        Task(0, 0, "X")


def test_example_files_parse_to_1f1b_and_slimpipe():
    assert load_schedule_file(ONE_F_ONE_B_CSV) == tasks_to_actions(_one_f_one_b(2, 4))
    assert load_schedule_file(SLICED_TOML, num_slices=4) == sliced_pipeline_actions(2, 2, 4)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.csv", "0F0,0F1,0X2\n1F0\n", r"bad.csv: rank 0 \(row 1\), position 2: '0X2' is not"),
        ("bad.toml", '[[rank]]\ntasks = ["F stage=0 mb=0", "F stage=0"]\n', "rank 0, task 1"),
        ("kind.toml", '[[rank]]\ntasks = ["Q stage=0 mb=0"]\n', "kind 'Q' is not one of"),
        ("mb.toml", '[[rank]]\ntasks = ["F stage=0 mb=x"]\n', "'mb=x' is not stage=N"),
        ("n.toml", 'num_slices = 4\n[[rank]]\ntasks = ["F stage=0 mb=0"]\n', "num_slices = 4"),
        ("key.toml", 'slices = 4\n[[rank]]\ntasks = ["F stage=0 mb=0"]\n', "unknown top-level"),
        ("norank.toml", "num_slices = 1\n", r"no \[\[rank\]\] tables"),
        ("plan.txt", "0F0\n", "unknown format '.txt'"),
    ],
)
def test_malformed_files_name_the_file_rank_and_position(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ScheduleError, match=message) as error:
        load_schedule_file(path)
    assert name in str(error.value)


# -- checks ----------------------------------------------------------------------------------

_GOOD_1F1B = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]


@pytest.mark.parametrize(
    ("rows", "shape", "message"),
    [
        (  # slices forward out of order
            ["0F1 0F0 0B1 0B0", "1F0 1F1 1B1 1B0"],
            (1, 2),
            r"rank 0, position 0 \(0F1 = F stage=0 mb=0 slice=1\): runs before the forward of "
            "slice 0",
        ),
        (  # slices backward in increasing order
            ["0F0 0F1 0B1 0B0", "1F0 1F1 1B0 1B1"],
            (1, 2),
            r"rank 1, position 2 \(1B0 = B stage=1 mb=0 slice=0\): runs before the backward of "
            "slice 1; .* strictly decreasing slice order",
        ),
        (["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], (2, 1), r"rank 1, position 0 \(1B0 .* own forw"),
        (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1"], (2, 1), r"stage=1 mb=1 \(rank 1\) has no backward"),
        (["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], (2, 1), r"add 0B1, or both 0I1 and 0W1"),
        (["0F0 0B0 1F1 1B1", "1F0 1B0 0F1 0B1"], (2, 1), "stage 1 is on two ranks: rank 0, posi"),
        (["0F0 0F1 0B0 0B1", "1F0 1I0 1W0 1F1 1I1 1W1"], (1, 2), r"\(1I0 .* split backward"),
        (["0F0 0F1 0B0 0B1", "1F0 1W0 1I0 1F1 1I1 1W1"], (2, 1), "runs before its input backw"),
        (["0F0 0F1 0B0 0B1", "1F0 1I0 1F1 1B1"], (2, 1), "has I without W; add 1W0 after it"),
        (["0F0 0F0 0F1 0B0 0B1", _GOOD_1F1B[1]], (2, 1), r"position 1 .* runs twice \(first at"),
        (["0F0 0F1 0B0 0B1 0SEND_F0", _GOOD_1F1B[1]], (2, 1), "only F, B, I and W actions"),
        (["0F0 0F1 0B0 0B1 2F0", _GOOD_1F1B[1]], (2, 1), "stage 2 is outside 0..1"),
        (["0F0 0F1 0B0 0B1", ""], (2, 1), "rank 1 runs nothing"),
    ],
)
def test_each_check_rule_names_rank_position_action_and_rule(rows, shape, message):
    num_microbatches, num_slices = shape
    with pytest.raises(ScheduleError, match=message):
        check_schedule(
            _parse(rows), num_stages=2, num_microbatches=num_microbatches, num_slices=num_slices
        )


def test_stages_on_one_rank_run_in_dependency_order():
    # two stages on rank 0, one on rank 1; stage 1's forward before stage 0's on rank 0
    rows = ["1F0 0F0 1B0 0B0", "2F0 2B0"]
    with pytest.raises(ScheduleError, match="before the forward of stage 0 on this rank"):
        check_schedule(_parse(rows), num_stages=3, num_microbatches=1)
    rows = ["0F0 1F0 0B0 1B0", "2F0 2B0"]
    with pytest.raises(ScheduleError, match="before the backward of stage 1 on this rank"):
        check_schedule(_parse(rows), num_stages=3, num_microbatches=1)
    assert check_schedule(_parse(["0F0 1F0 1B0 0B0", "2F0 2B0"]), num_stages=3, num_microbatches=1)


def test_deadlock_is_found_before_running_and_names_the_rank_and_action():
    """Rank 0 waits for the backward of microbatch 0, which rank 1 runs only after the forward
    of microbatch 1, which rank 0 sends only after that backward."""
    rows = ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 waits forever .* \(0B0\)") as error:
        check_schedule(_parse(rows), num_stages=2, num_microbatches=2)
    assert (error.value.rank, str(error.value.action), str(error.value.waiting_for)) == (
        0,
        "0B0",
        "1B0",
    )
    assert check_schedule(_parse(_GOOD_1F1B), num_stages=2, num_microbatches=2) == {0: 0, 1: 1}


# -- config ----------------------------------------------------------------------------------


def _plan(parallelism: ParallelismConfig):
    llama = get_model_spec("llama")
    shape = llama.shape(llama.flavor("debug"))
    return plan_pipeline(parallelism, llama.structure, shape, local_batch_size=8, seq_len=64)


def test_plan_reads_the_file_and_places_stages_where_it_runs_them(tmp_path):
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=2, microbatches=4, pipeline_schedule_file=str(ONE_F_ONE_B_CSV)
    )
    plan = _plan(parallelism)
    assert (plan.schedule, plan.num_slices, plan.num_microbatches) == ("user", 1, 4)
    assert [plan.stage_indices(rank) for rank in (0, 1)] == [[0], [1]]
    assert plan.actions_by_rank == load_schedule_file(ONE_F_ONE_B_CSV)
    v_placed = tmp_path / "v.csv"  # rank 0 holds stages 0 and 3
    v_placed.write_text("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n")
    parallelism.pipeline_schedule_file, parallelism.microbatches = str(v_placed), 1
    with pytest.raises(ValueError, match=r"runs 4 stages .* set stages_per_rank = 2"):
        _plan(parallelism)
    parallelism.stages_per_rank = 2
    plan = _plan(parallelism)
    assert [plan.stage_indices(rank) for rank in (0, 1)] == [[0, 3], [1, 2]]


def test_a_bad_schedule_file_fails_config_validation_with_its_name(tmp_path):
    config = JobConfig()
    config.training.global_batch_size, config.training.seq_len = 4, 64
    config.parallelism = ParallelismConfig(
        dp_shard=1, pipeline_parallel_degree=2, microbatches=4, pipeline_schedule_file="none.csv"
    )
    with pytest.raises(ConfigError, match=r"schedule file 'none\.csv' does not exist"):
        validate_job(config, world_size=2)
    broken = tmp_path / "broken.csv"
    broken.write_text("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3\n")
    config.parallelism.pipeline_schedule_file = str(broken)
    with pytest.raises(ConfigError, match=r"broken.csv.*stage=1 mb=3 \(rank 1\) has no backward"):
        validate_job(config, world_size=2)
    config.parallelism.pipeline_schedule_file = str(ONE_F_ONE_B_CSV)
    validate_job(config, world_size=2)
    config.parallelism.microbatches = 2
    with pytest.raises(ConfigError, match=r"runs 4 microbatches .* set microbatches = 4"):
        validate_job(config, world_size=2)


# -- runs ------------------------------------------------------------------------------------


def _run(
    rank: int,
    world: int,
    schedule: str,
    m: int,
    n: int,
    actions=None,
    checked: bool = True,
    num_stages: int = 2,
) -> tuple[float | None, dict[str, torch.Tensor]]:
    """One step of the tiny Llama (one layer per stage) on the parity batch's first ROWS
    sequences; a user schedule's stages are placed where its lists run them."""
    runner = tiny_pipeline(
        pp_mesh(world),
        schedule=schedule if checked else "sliced",
        stages_per_rank=num_stages // world,
        microbatches=m,
        num_slices=n,
        rows=ROWS,
        seq_len=PARITY_SEQ_LEN,
        user_actions=actions if checked else None,
    )
    if not checked:  # what UserPipelineSchedule does, without check_schedule
        unchecked = PipelineScheduleRuntime(
            runner.stages, m * n, loss_fn=token_sum_cross_entropy, scale_grads=False
        )
        unchecked.pipeline_order = dict(actions)
        unchecked._prepare_schedule_with_comms(actions)
        runner.schedule = unchecked
    return runner_step(runner, tiny_batch()[:ROWS])


def _run_many(rank: int, world: int, configs: list[tuple]) -> list[tuple]:
    return [_run(rank, world, *config) for config in configs]


def _merged(results: list[list[tuple]], index: int) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, every gradient) of config `index`, gathered over the ranks."""
    loss = next(per_rank[index][0] for per_rank in results if per_rank[index][0] is not None)
    return loss, {name: g for per_rank in results for name, g in per_rank[index][1].items()}


def test_user_schedules_match_torch_1f1b_fp64():
    configs = [
        ("1F1B", 4, 1),
        ("user", 4, 1, tasks_to_actions(_one_f_one_b(2, 4))),
        ("user", 4, 1, load_schedule_file(ONE_F_ONE_B_CSV)),
        ("user", 4, 1, tasks_to_actions(_zero_bubble_h1())),
        ("user", 2, 4, load_schedule_file(SLICED_TOML, num_slices=4)),
    ]
    results = run_on_ranks(_run_many, 2, configs, timeout=120)
    torch_1f1b = _merged(results, 0)
    differences = [
        max_relative_difference([per_rank[index] for per_rank in results], torch_1f1b)
        for index in range(1, len(configs))
    ]
    assert max(differences[:3]) <= PARITY, differences  # 1F1B from Tasks and CSV, ZB-H1
    assert differences[3] <= 1e-10, differences  # sliced: another split, round-off only


def test_v_placed_user_schedule_matches_torch_zbv_fp64():
    configs = [
        ("ZBVZeroBubble", 4, 1, None, True, 4),
        ("user", 4, 1, tasks_to_actions(_v_shaped_gpipe(4)), True, 4),
    ]
    results = run_on_ranks(_run_many, 2, configs, timeout=120)
    difference = max_relative_difference([per_rank[1] for per_rank in results], _merged(results, 0))
    assert difference <= PARITY, difference


def test_unchecked_ascending_backward_slices_fail_only_mid_step():
    """The ablation: the check rejects backwards in increasing slice order before any process
    group; run unchecked, the same lists fail inside the step, at the KV cache."""
    ascending = _backward_slices_ascending(sliced_pipeline_actions(2, 2, 4), num_slices=4)
    with pytest.raises(ScheduleError, match="strictly decreasing slice order"):
        check_schedule(ascending, num_stages=2, num_microbatches=2, num_slices=4)
    with pytest.raises(RankFailedError, match="slices must go backward in reverse order"):
        run_on_ranks(_run, 2, "user", 2, 4, ascending, False, timeout=60)
