"""`python -m pipekit.layout_search --config x.toml --world-size N [--device h100] [...]`.

Enumerates the layouts the job's rules allow on N ranks, predicts each one's per-rank peak
(the memory plan's terms) and step time (the schedule simulator at the device's FLOP/s and link
bandwidths), and prints the ten fastest that fit, each split into compute, recomputation,
exposed communication and bubble, then why the fastest ones that do not fit do not. The model,
context length and global batch come from the config; its degrees, schedule and activation
policy are what the search chooses. Exits with status 2 when nothing fits.
"""

from __future__ import annotations

import argparse
import sys

from pipekit.config.loader import ConfigError, load_job_config
from pipekit.layout_search.devices import DEVICE_PROFILES, DeviceProfile, device_profile
from pipekit.layout_search.search import (
    Candidate,
    LayoutSearch,
    SearchResult,
    nothing_fits,
    search_layouts,
)
from pipekit.memory_plan.__main__ import parse_bytes, refusal
from pipekit.memory_plan.memory import plan_memory
from pipekit.text_table import format_table
from pipekit.train.job import validate_job

__all__ = ["describe_candidates", "device_from_options", "main", "report", "verify"]

_GIB = 2**30
_OVERRIDES = {
    "memory": ("memory_bytes", parse_bytes, "device memory, e.g. 80GiB"),
    "peak-flops": ("peak_flops", float, "peak FLOP/s of one device in the compute dtype"),
    "efficiency": ("efficiency", float, "share of the peak the model's FLOPs reach"),
    "intra-node-bandwidth": ("intra_node_bandwidth", float, "bytes/s to a peer in the node"),
    "inter-node-bandwidth": ("inter_node_bandwidth", float, "bytes/s to a peer in another node"),
    "host-bandwidth": ("host_bandwidth", float, "bytes/s to host memory (offload)"),
    "devices-per-node": ("devices_per_node", int, "devices that share the fast links"),
}


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.layout_search",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks the job runs on")
    parser.add_argument(
        "--device",
        default="h100",
        help=f"device profile: {', '.join(DEVICE_PROFILES)} or cpu (measured here)",
    )
    for flag, (_, _, text) in _OVERRIDES.items():
        parser.add_argument(f"--{flag}", default=None, help=f"override the profile's {text}")
    parser.add_argument("--top", type=int, default=10, help="fitting layouts to print")
    parser.add_argument(
        "--verify",
        type=int,
        default=0,
        help="build the memory plan (python -m pipekit.memory_plan) of the first N printed "
        "layouts and print its peak beside the search's",
    )
    return parser.parse_known_args(argv)


def device_from_options(options: argparse.Namespace) -> DeviceProfile:
    """The profile `--device` names with the override flags given."""
    overrides = {}
    for flag, (field, parse, _) in _OVERRIDES.items():
        value = getattr(options, flag.replace("-", "_"))
        if value is not None:
            overrides[field] = parse(value)
    return device_profile(options.device, **overrides)


def describe_candidates(candidates: list[Candidate]) -> None:
    """The table of predicted layouts, fastest first."""
    rows = []
    for index, candidate in enumerate(candidates, 1):
        step = candidate.step
        rows.append([
            index, candidate.layout.label(), candidate.peak_bytes / _GIB, step.step_s,
            step.tokens_per_s, f"{100 * step.mfu:.1f}%",
            f"{100 * step.compute_s / step.step_s:.0f}%",
            f"{100 * step.recompute_s / step.step_s:.0f}%",
            f"{100 * step.exposed_communication_s / step.step_s:.0f}%",
            f"{100 * step.bubble_s / step.step_s:.0f}%",
            f"{100 * step.overhead_s / step.step_s:.0f}%",
        ])  # fmt: skip
    headers = ["#", "layout", "peak GiB", "step s", "tokens/s", "MFU", "compute"]
    print(format_table([*headers, "recompute", "exposed comm", "bubble", "overhead"], rows))


def report(search: LayoutSearch, result: SearchResult, top: int) -> list[Candidate]:
    """Print the search's findings; the printed fitting layouts (validated as jobs)."""
    device = search.device
    kept = search.validated(result, top)
    print(
        f"{len(result.fitting)} of {result.structures} layout structures fit (fastest activation "
        f"policy each), {len(result.excluded)} fit under no policy, "
        f"{sum(result.refused.values())} refused by the job's rules; {result.seconds:.1f} s\n"
    )
    if kept:
        print(f"the {len(kept)} fastest layouts that fit (each passes validate_job):")
        describe_candidates(kept)
    for layout, reason in result.invalid:
        print(f"predicted to fit but refused as a job: {layout.label()}: {reason}")
    if result.excluded:
        print("\nthe fastest layouts that do not fit, at their smallest peak:")
        for candidate in result.excluded[:5]:
            print(
                f"  {candidate.layout.label()}: {candidate.step.tokens_per_s:.4g} tokens/s "
                f"predicted; {refusal(candidate.worst_rank, device.memory_bytes)}"
            )
    if result.refused:
        print("\nrefused by the job's rules (structures, reason):")
        for reason, count in result.refused.most_common(5):
            print(f"  {count:4d}  {reason}")
    return kept


def verify(search: LayoutSearch, candidates: list[Candidate]) -> None:
    """Each layout's memory plan, built for real (`plan_memory`), beside the search's peak."""
    rows = []
    for candidate in candidates:
        job = validate_job(
            search.job_config(candidate.layout), search.world_size, check_files=False
        )
        planned = plan_memory(job).peak
        rows.append([
            candidate.layout.label(), candidate.peak_bytes / _GIB, planned / _GIB,
            f"{100 * (candidate.peak_bytes / planned - 1):+.2f}%",
        ])  # fmt: skip
    print("\nthe memory plan of each layout, built on the meta device:")
    print(format_table(["layout", "search GiB", "memory plan GiB", "difference"], rows))


def main(argv: list[str]) -> None:
    options, config_argv = _parse(argv)
    try:
        device = device_from_options(options)
        config = load_job_config(config_argv)
        search, result = search_layouts(config, options.world_size, device)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"{config.job.name}: {config.model.name} {config.model.flavor}, "
        f"{config.training.global_batch_size} x {config.training.seq_len} tokens per step, on "
        f"{options.world_size} x {device.name} ({device.memory_bytes / _GIB:.1f} GiB, "
        f"{device.peak_flops / 1e12:.4g} TFLOP/s peak at {device.efficiency:g} efficiency, "
        f"{device.devices_per_node} per node, links {device.intra_node_bandwidth / 1e9:.4g} / "
        f"{device.inter_node_bandwidth / 1e9:.4g} GB/s within / across nodes)"
    )
    kept = report(search, result, options.top)
    if not kept:
        print(f"error: {nothing_fits(result, device)}", file=sys.stderr)
        raise SystemExit(2)
    if options.verify:
        verify(search, kept[: options.verify])
    best = kept[0]
    print(
        f"\nfastest: {best.layout.label()}, {best.step.tokens_per_s:.4g} tokens/s, MFU "
        f"{100 * best.step.mfu:.1f}%, peak {best.peak_bytes / _GIB:.2f} GiB per device"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
