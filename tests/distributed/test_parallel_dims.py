"""ParallelDims: resolution of -1, every validation error (before any process group), and the
meshes build_mesh lays out on 1 and 4 gloo ranks."""

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import data_parallel_mesh
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.distributed.process_group import destroy_distributed, init_distributed
from pipekit.testing import RankFailedError, run_on_ranks


def _resolve(world_size: int, **degrees: int) -> ParallelDims:
    return ParallelDims.from_config(ParallelismConfig(**degrees), world_size)


@pytest.mark.parametrize(
    ("world_size", "degrees", "want"),
    [
        (8, {}, {"dp_shard": 8}),
        (8, {"tp": 2, "pipeline_parallel_degree": 2}, {"dp_shard": 2, "tp": 2, "pp": 2}),
        (8, {"dp_replicate": -1, "dp_shard": 2}, {"dp_replicate": 4, "dp_shard": 2}),
        (8, {"dp_shard": 2, "tp": -1}, {"dp_shard": 2, "tp": 4}),
        (4, {"dp_shard": 2, "cp": 2}, {"dp_shard": 2, "cp": 2}),
        (1, {}, {"dp_shard": 1}),
    ],
)
def test_resolves_minus_one_to_the_rest(world_size, degrees, want):
    dims = _resolve(world_size, **degrees)
    expected = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, **want}
    assert {name: getattr(dims, name) for name in expected} == expected
    assert dims.world_size == world_size


def test_properties_follow_the_degrees():
    dims = _resolve(16, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)
    assert dims.dp_degree == 4 and dims.dp_enabled and dims.fsdp_enabled
    assert dims.cp_enabled and dims.tp_enabled and dims.ep_enabled and not dims.pp_enabled
    single = _resolve(1)
    assert not (single.dp_enabled or single.fsdp_enabled or single.dp_replicate_enabled)
    assert _resolve(2, dp_replicate=2, dp_shard=1).fsdp_enabled is False


@pytest.mark.parametrize(
    ("world_size", "degrees", "message"),
    [
        (
            2,
            {"dp_shard": 2, "tp": 2},
            r"dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 x pipeline_parallel_degree=1 = 4 "
            r"!= world size 2; "
            r"set dp_shard=-1 \(or another degree\) to take the rest, or launch 4 processes",
        ),
        (4, {"dp_shard": -1, "tp": -1}, r"only one degree may be -1, got dp_shard, tp"),
        (
            6,
            {"tp": 4},
            r"dp_replicate=1 x cp=1 x tp=4 x pipeline_parallel_degree=1 = 4 does not divide "
            r"world size 6, so dp_shard=-1",
        ),
        (4, {"tp": 0}, r"parallelism.tp=0 is invalid; use a degree >= 1, or -1"),
        (
            4,
            {"pipeline_parallel_degree": -2},
            r"parallelism.pipeline_parallel_degree=-2 is invalid",
        ),
        (4, {"ep": 3}, r"ep=3 must divide dp_replicate x dp_shard x cp x tp = 4"),
        (4, {"dp_shard": 2, "tp": 2, "ep": 8}, r"ep=8 must divide .* = 4 \(experts borrow"),
        (4, {"ep": -1}, r"ep=-1 is not supported"),
        (0, {}, r"world size 0 must be >= 1"),
    ],
)
def test_invalid_degrees_name_the_problem_and_the_fix(world_size, degrees, message):
    with pytest.raises(ValueError, match=message):
        _resolve(world_size, **degrees)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match=r"parallelism.cp=0 must be >= 1 once resolved"):
        ParallelDims(dp_replicate=1, dp_shard=1, cp=0, tp=1, pp=1, ep=1, world_size=1)


def test_mesh_needs_building_and_a_process_group():
    dims = _resolve(1)
    assert dims.dp_rank(None) == 0
    with pytest.raises(RuntimeError, match=r"call ParallelDims.build_mesh"):
        dims.mesh("dp")
    with pytest.raises(RuntimeError, match=r"call pipekit.distributed.process_group"):
        dims.build_mesh("cpu")


def test_init_distributed_without_torchrun_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = init_distributed(timeout_s=10)
    assert (info.rank, info.world_size, info.device_type) == (0, 1, "cpu")
    assert not dist.is_initialized()
    destroy_distributed()  # a no-op without a group
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"):
        init_distributed(timeout_s=10)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(RuntimeError, match=r"MASTER_PORT=0 .* `torchrun --standalone"):
        init_distributed(timeout_s=10)


def _torchrun_like(rank: int, world_size: int, port: int) -> tuple[int, int, str]:
    """init_distributed from torchrun's variables, in a child whose helper group is gone."""
    dist.destroy_process_group()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    info = init_distributed(timeout_s=30)
    backend = dist.get_backend()
    dist.barrier()
    destroy_distributed()
    return info.rank, info.world_size, backend


# A free port is released before rank 0 binds it: a test running beside this one (another
# pytest worker) may take it in between, and the ranks then meet a stranger's store or sockets.
_PORT_TAKEN = ("Address already in use", "connectFullMesh failed", "Connection closed by peer")


def test_init_distributed_joins_the_torchrun_group_with_gloo_on_cpu():
    for attempt in range(3):  # a fresh port when another process took the last one
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            joined = run_on_ranks(_torchrun_like, 2, port)
            break
        except RankFailedError as error:
            if attempt == 2 or not any(sign in str(error) for sign in _PORT_TAKEN):
                raise
    assert joined == [(0, 2, "gloo"), (1, 2, "gloo")]


def _mesh_layout(rank: int, world_size: int, degrees: dict[str, int]) -> dict:
    dims = ParallelDims.from_config(ParallelismConfig(**degrees), world_size)
    world_mesh = dims.build_mesh("cpu")
    names = ["world", "pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"]
    dp_mesh = data_parallel_mesh(world_mesh, dims)
    wrong_mesh_error = None
    if dims.dp_replicate_enabled and dims.dp_shard_enabled:
        with pytest.raises(ValueError) as error:
            data_parallel_mesh(dims.mesh("dp"), dims)  # a flattened helper, not the world mesh
        wrong_mesh_error = str(error.value)
    return {
        "wrong_mesh_error": wrong_mesh_error,
        "world": world_mesh.mesh_dim_names,
        "sizes": {name: dims.mesh(name).size() for name in names if dims.has_mesh(name)},
        "dp_rank": dims.dp_rank(world_mesh),
        "dp_group_rank": dims.mesh("dp").get_local_rank() if dims.has_mesh("dp") else None,
        "dp_mesh": None if dp_mesh is None else (dp_mesh.mesh_dim_names, tuple(dp_mesh.shape)),
    }


def test_build_mesh_keeps_dims_above_one_and_flattened_helpers():
    hsdp = run_on_ranks(_mesh_layout, 4, {"dp_replicate": 2, "dp_shard": 2})
    assert hsdp[3]["world"] == ("dp_replicate", "dp_shard")
    assert hsdp[3]["sizes"] == {
        "world": 4, "dp_replicate": 2, "dp_shard": 2, "dp": 4, "dp_shard_cp": 2, "dp_cp": 4,
    }  # fmt: skip
    assert [layout["dp_rank"] for layout in hsdp] == [0, 1, 2, 3]
    assert [layout["dp_group_rank"] for layout in hsdp] == [0, 1, 2, 3]
    assert hsdp[0]["dp_mesh"] == (("dp_replicate", "dp_shard"), (2, 2))
    assert (
        "mesh with dims ('dp',) lacks ['dp_replicate', 'dp_shard']" in hsdp[0]["wrong_mesh_error"]
    )
    assert "pass the mesh that parallel_dims.build_mesh() returned" in hsdp[0]["wrong_mesh_error"]
    tp_pp = run_on_ranks(_mesh_layout, 4, {"dp_shard": 1, "tp": 2, "pipeline_parallel_degree": 2})
    assert tp_pp[0]["world"] == ("pp", "tp")
    assert tp_pp[0]["sizes"] == {"world": 4, "pp": 2, "tp": 2}
    assert tp_pp[0]["dp_mesh"] is None
    assert [layout["dp_rank"] for layout in tp_pp] == [0, 0, 0, 0]
    dp_tp = run_on_ranks(_mesh_layout, 4, {"dp_shard": 2, "tp": 2})
    assert [layout["dp_rank"] for layout in dp_tp] == [0, 0, 1, 1]  # tp is the inner dim
    assert dp_tp[0]["dp_mesh"] == (("dp_shard",), (2,))
    cp = run_on_ranks(_mesh_layout, 4, {"dp_replicate": 2, "dp_shard": 1, "cp": 2})
    assert cp[0]["sizes"]["dp_shard_cp"] == 2 and cp[0]["sizes"]["dp_cp"] == 4
    assert cp[0]["dp_mesh"] == (("dp_replicate", "dp_shard_cp"), (2, 2))


def test_build_mesh_on_a_world_of_one():
    (layout,) = run_on_ranks(_mesh_layout, 1, {})
    assert layout["world"] == ("dp_shard",)
    assert layout["sizes"] == {"world": 1, "dp_shard": 1, "dp": 1, "dp_shard_cp": 1, "dp_cp": 1}
    assert layout["dp_mesh"] is None and layout["dp_rank"] == 0


def test_exit_process_runs_exit_handlers_and_flushes_before_it_ends():
    """A rank ends through exit_process: its exit handlers run and its buffered output arrives,
    although the interpreter's finalization is skipped."""
    program = (
        "import atexit, sys\n"
        "from pipekit.distributed.process_group import exit_process\n"
        "atexit.register(lambda: print('handler ran'))\n"
        "print('buffered', end='')\n"
        "sys.stderr.write('on stderr')\n"
        "exit_process(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert result.returncode == 3
    assert result.stdout == "bufferedhandler ran\n"
    assert result.stderr == "on stderr"
