"""`python -m pipekit.bench layout-search`: the layout search at SlimPipe's published settings,
beside the paper's layouts and MFU.

For each row of the paper's Table 4 that pipekit has a model for ("SlimPipe: Memory-Thrifty
and Efficient Pipeline Parallelism for Long-Context LLM Training": Llama 70B at 2048K and
Mixtral 8x7B at 4096K on 256 Hopper 80 GB GPUs, 16M tokens per iteration) it runs the search
on the built-in h100 profile and prints side by side: the paper's layout and measured MFU, the
search's fastest layout and its predicted MFU, the search's prediction for the paper's own
layout, and the fastest layout without the sliced schedules (torch's schedules with whatever
recomputation, cp and tp fit: the Megatron-style baseline), with the predicted ratio of the two.
The paper checkpoints selectively and offloads at once, which pipekit refuses (checkpointed
blocks keep their tensors out of the offload's reach); its layout is priced with offload alone.
Predictions rest on the profile's stated efficiency (0.5 of peak) and link figures: they are
the model's, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pipekit.bench.report import print_result, print_table
from pipekit.config.loader import ConfigError, load_job_config
from pipekit.layout_search import Candidate, Layout, LayoutSearch, SearchSpace, device_profile
from pipekit.pipelining.schedules.registry import SCHEDULES

__all__ = ["PAPER_ROWS", "main"]


@dataclasses.dataclass(frozen=True)
class PaperRow:
    """One published setting and what the paper ran there."""

    name: str
    config: str
    seq_len: int
    world_size: int
    layout: Layout
    mfu: float


PAPER_ROWS = (
    PaperRow(
        "Llama 70B 2048K",
        "configs/llama3_70b_2m_slimpipe.toml",
        2**21,
        256,
        Layout(
            pp=16, dp_replicate=1, dp_shard=1, cp=4, tp=4, num_slices=64, activation_offload=0.75
        ),
        0.450,
    ),
    PaperRow(
        "Mixtral 8x7B 4096K",
        "configs/mixtral_8x7b_4m_slimpipe.toml",
        2**22,
        256,
        Layout(
            pp=16,
            dp_replicate=1,
            dp_shard=1,
            cp=16,
            tp=1,
            ep=8,
            num_slices=64,
            activation_offload=0.95,
        ),
        0.400,
    ),
)
"""Table 4's rows pipekit has models for (t, c, e, d, p, n, offload, MFU)."""

_TOKENS_PER_ITERATION = 16 * 2**20


def _paper_candidate(search: LayoutSearch, layout: Layout) -> Candidate | str:
    """The search's prediction for the paper's layout, or why pipekit cannot run it."""
    try:
        job = search.job(layout)
    except ConfigError as error:
        return f"refused: {error}"
    layouts = search.share_layouts(job)
    return search.candidate(job, layout, search.memory(job, layouts), layouts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench layout-search",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="h100", help="device profile (default h100)")
    options = parser.parse_args(argv)
    device = device_profile(options.device)
    rows, figures = [], {}
    for row in PAPER_ROWS:
        config = load_job_config([
            "--config", row.config, "--training.seq_len", str(row.seq_len),
            "--training.global_batch_size", str(_TOKENS_PER_ITERATION // row.seq_len),
        ])  # fmt: skip
        start = time.perf_counter()
        space = SearchSpace(world_size=row.world_size, devices_per_node=device.devices_per_node)
        search = LayoutSearch(config, row.world_size, device, space)
        result = search.run()
        best = search.validated(result, 1)[0]
        torch_only = [
            candidate for candidate in result.fitting
            if candidate.layout.pp == 1 or not SCHEDULES[candidate.layout.schedule].sliced
        ]  # fmt: skip
        baseline = search.validated(dataclasses.replace(result, fitting=torch_only), 1)
        paper = _paper_candidate(search, row.layout)
        seconds = time.perf_counter() - start
        paper_text = paper if isinstance(paper, str) else (
            f"{100 * paper.step.mfu:.1f}% ({paper.peak_bytes / 2**30:.1f} GiB"
            f"{'' if paper.peak_bytes <= device.memory_bytes else ', does not fit'})"
        )  # fmt: skip
        baseline_mfu = baseline[0].step.mfu if baseline else float("nan")
        rows.append([
            row.name, row.layout.label(), f"{100 * row.mfu:.1f}%", best.layout.label(),
            f"{100 * best.step.mfu:.1f}%", paper_text,
            baseline[0].layout.label() if baseline else "none fits",
            f"{100 * baseline_mfu:.1f}%", best.step.mfu / baseline_mfu, seconds,
        ])  # fmt: skip
        key = row.name.split()[0].lower() + "_" + row.name.split()[-1].lower()
        figures[f"{key}_best_mfu"] = best.step.mfu
        figures[f"{key}_paper_layout_mfu"] = (
            float("nan") if isinstance(paper, str) else paper.step.mfu
        )
        figures[f"{key}_vs_torch_schedules"] = best.step.mfu / baseline_mfu
    print(
        f"device {device.name}: {device.peak_flops / 1e12:.0f} TFLOP/s peak at "
        f"{device.efficiency:g} efficiency, {device.memory_bytes / 2**30:.0f} GiB, "
        f"{device.devices_per_node} per node; 16M tokens per iteration\n"
    )
    headers = ["setting", "paper layout", "paper MFU", "search's best", "predicted MFU"]
    headers += ["paper layout predicted", "best without sliced", "its MFU", "ratio", "search s"]
    print_table(headers, rows)
    print(
        "\nthe paper's measured ratios over Megatron-LM (interleaved 1F1B) at 512K: Mixtral 8x7B "
        "on 128 GPUs 1.57x, 8x22B on 512 GPUs 1.41x (its Figure 12)"
    )
    print_result(**figures)


if __name__ == "__main__":
    main()
