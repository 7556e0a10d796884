"""What a benchmark run leaves behind: `bench.json` (everything measured), `bench.png` (tok/s against the roofline,
and the GPU-busy timelines of native and native_sync) and the printed table."""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.hardware import HardwareRates
from bench_lib.roofline import RooflineFloor
from bench_lib.systems import SystemResult
from bench_lib.workloads import BenchRequests

TIMELINE_WINDOW_S = 0.05  # a slice short enough to see the idle gaps between steps


@dataclass(frozen=True)
class WorkloadReport:
    requests: BenchRequests
    model: str
    floor: RooflineFloor | None
    results: tuple[SystemResult, ...]
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it did not run (not installed)
    errors: dict[str, str] = field(default_factory=dict)  # system -> the exception it raised

    def fraction_of_roofline(self, result: SystemResult) -> float | None:
        """Floor time over measured time, as a throughput ratio so that a run cut by the time limit compares too."""
        if self.floor is None:
            return None
        return result.tok_per_s / self.floor.tok_per_s


def result_from_json(fields: dict[str, Any]) -> SystemResult:
    """A SystemResult back from the JSON a measuring process wrote (`dataclasses.asdict`)."""
    timeline = fields.get("busy_timeline")
    return SystemResult(**{**fields, "busy_timeline": tuple(map(tuple, timeline)) if timeline else None})


def _result_json(report: WorkloadReport, result: SystemResult) -> dict[str, Any]:
    fields = asdict(result)
    fields.pop("busy_timeline")
    return {
        **fields,
        "tok_per_s": result.tok_per_s,
        "fraction_of_roofline": report.fraction_of_roofline(result),
        "host_ms_per_step": result.host_ms_per_step,
    }


def _workload_json(report: WorkloadReport) -> dict[str, Any]:
    spec = report.requests.spec
    floor = report.floor
    return {
        "name": spec.name,
        "title": spec.title,
        "architecture": spec.architecture,
        "model_dir": report.model,
        "requests": spec.requests,
        "prompt_tokens": int(report.requests.prompt_lengths.sum()),
        "output_tokens": report.requests.total_output_tokens,
        "roofline": None
        if floor is None
        else {**asdict(floor), "total_s": floor.total_s, "tok_per_s": floor.tok_per_s},
        # system -> run ("cold", "warm"; a later --repeat round "cold 2", ...) -> result
        "systems": {
            system: {r.label: _result_json(report, r) for r in report.results if r.system == system}
            for system in dict.fromkeys(r.system for r in report.results)
        },
        "busy_timelines": {f"{r.system} {r.label}": r.busy_timeline for r in report.results if r.busy_timeline},
        "skipped": report.skipped,
        "errors": report.errors,
    }


def provenance(argv: list[str]) -> dict[str, Any]:
    """The command, when it ran and the versions it ran with: the head of a benchmark's JSON."""
    import torch
    import transformers

    return {
        "argv": argv,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write_json(path: Path, reports: list[WorkloadReport], hardware: HardwareRates | None, run: dict) -> None:
    document = {
        "run": run,
        "hardware": None
        if hardware is None
        else {
            **asdict(hardware),
            "copy_tb_per_s": hardware.copy_bytes_per_s / 1e12,
            "matmul_tflops": hardware.matmul_flops_per_s / 1e12,
        },
        "workloads": [_workload_json(r) for r in reports],
    }
    path.write_text(json.dumps(document, indent=2, default=float))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


# The name suffix of a system's runs from the other checkout (`scripts/bench.py --against`).
AGAINST = "@against"

# Widths of the table's columns after `system` (seconds, tokens, tok/s, roofline, GPU-busy, prep ms, host ms,
# start-up), for the rows that leave them blank.
COLUMNS_AFTER_SYSTEM = 9 + 10 + 10 + 10 + 10 + 9 + 9 + 10
COLUMNS_AFTER_TOK_S = 10 + 10 + 9 + 9 + 10


def table(reports: list[WorkloadReport], hardware: HardwareRates | None) -> str:
    """The summary a reader looks at first: one row per system per workload."""
    header = (
        f"{'workload':<9}{'system':<24}{'seconds':>9}{'tokens':>10}{'tok/s':>10}{'roofline':>10}"
        f"{'GPU-busy':>10}{'prep ms':>9}{'host ms':>9}{'start-up':>10}  note"
    )
    lines = [] if hardware is None else [hardware.summary()]
    lines += [header, "-" * len(header)]
    for report in reports:
        name = report.requests.spec.name
        if report.floor is not None:
            floor = report.floor
            lines.append(
                f"{name:<9}{'roofline':<24}{floor.total_s:>9.2f}{floor.output_tokens:>10}{floor.tok_per_s:>10.0f}"
                f"{'100%':>10}  decode {floor.decode_s:.2f} s + prefill {floor.prefill_s:.2f} s"
            )
        unconstrained = {r.label: r.tok_per_s for r in report.results if r.system == "native" and not r.cut}
        other = {(r.system, r.label): r.tok_per_s for r in report.results if r.system.endswith(AGAINST) and not r.cut}
        for r in report.results:
            status = f"cut at {r.requests_done}/{r.requests_total} requests" if r.cut else ""
            if r.system.startswith("native_json") and r.label in unconstrained and not r.cut:
                # structured outputs: their throughput against the same round's unconstrained run
                status = f"{r.tok_per_s / unconstrained[r.label]:.2f}x of native {r.label}"
            twin = (r.system + AGAINST, r.label)
            if twin in other and not r.cut:
                # --against: this checkout's run against the other checkout's of the same round
                status = f"{r.tok_per_s / other[twin]:.3f}x of {twin[0]} {r.label}"
            status = "; ".join(part for part in (status, held_for_check(r)) if part)
            lines.append(
                f"{name:<9}{r.system + ' ' + r.label:<24}{r.wall_s:>9.2f}{r.output_tokens:>10}{r.tok_per_s:>10.0f}"
                f"{_percent(report.fraction_of_roofline(r)):>10}{_percent(r.gpu_busy_fraction):>10}"
                f"{_fmt(r.prep_ms_per_step, '.2f'):>9}{_fmt(r.host_ms_per_step, '.2f'):>9}"
                f"{r.startup_s:>10.1f}  {status}"
            )
        lines += _medians(name, report)
        for system, reason in {**report.skipped, **report.errors}.items():
            lines.append(f"{name:<9}{system:<24}{'':>{COLUMNS_AFTER_SYSTEM}}  {reason}")
    return "\n".join(lines)


def held_for_check(result: SystemResult) -> str:
    """A native cold run's results held for the engine's check of its config reading, which a run's seconds
    include: "" where they were not (or for less than 0.05 s)."""
    held = result.engine_stats.get("spec_check_wait_s", 0.0)
    return f"results held {held:.1f} s for the config check" if held >= 0.05 else ""


def _medians(name: str, report: WorkloadReport) -> list[str]:
    """With several --repeat rounds: each system's median tok/s per kind of run, and a structured-output system's
    median ratio to the unconstrained run of the same round."""
    lines = []
    done = [r for r in report.results if not r.cut]
    for system, run in dict.fromkeys((r.system, r.run) for r in done):
        rounds = {r.repeat: r.tok_per_s for r in done if (r.system, r.run) == (system, run)}
        if len(rounds) < 2:
            continue
        rate = statistics.median(rounds.values())
        status = f"median of {len(rounds)}"
        native = {r.repeat: r.tok_per_s for r in done if (r.system, r.run) == ("native", run)}
        ratios = [rounds[k] / native[k] for k in rounds if k in native]
        if system.startswith("native_json") and ratios:
            listed = ", ".join(f"{x:.2f}" for x in ratios)
            status += f"; {statistics.median(ratios):.2f}x of native {run} (rounds: {listed})"
        twin = {r.repeat: r.tok_per_s for r in done if (r.system, r.run) == (system + AGAINST, run)}
        against = [rounds[k] / twin[k] for k in rounds if k in twin]
        if against:
            listed = ", ".join(f"{x:.3f}" for x in against)
            status += f"; {statistics.median(against):.3f}x of {system}{AGAINST} {run} (rounds: {listed})"
        label = f"{system} {run} median"
        lines.append(f"{name:<9}{label:<24}{'':>19}{rate:>10.0f}{'':>{COLUMNS_AFTER_TOK_S}}  {status}")
    return lines


def plot(path: Path, reports: list[WorkloadReport]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = _timeline_pair(reports)
    panels = 2 if timelines else 1
    fig, axes = plt.subplots(panels, 1, figsize=(11, 4.5 * panels), squeeze=False)
    _throughput_panel(axes[0][0], reports)
    if timelines:
        _timeline_panel(axes[1][0], *timelines)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _throughput_panel(ax, reports: list[WorkloadReport]) -> None:
    systems = list(dict.fromkeys((r.system, r.label) for report in reports for r in report.results))
    width = 0.8 / max(len(systems), 1)
    for i, (system, run) in enumerate(systems):
        xs, ys = [], []
        for w, report in enumerate(reports):
            for r in report.results:
                if (r.system, r.label) == (system, run):
                    xs.append(w - 0.4 + (i + 0.5) * width)
                    ys.append(r.tok_per_s)
        bars = ax.bar(xs, ys, width=width, label=f"{system} ({run})")
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7)
    for w, report in enumerate(reports):
        if report.floor is not None:
            label = "roofline" if w == 0 else None
            ax.hlines(report.floor.tok_per_s, w - 0.45, w + 0.45, colors="black", linestyles="--", label=label)
            ax.annotate(f"{report.floor.tok_per_s:,.0f}", (w + 0.45, report.floor.tok_per_s), fontsize=7)
    ax.set_xticks(range(len(reports)))
    ax.set_xticklabels(
        [f"{r.requests.spec.name} {r.requests.spec.title}\n{r.requests.spec.architecture}" for r in reports]
    )
    ax.set_ylabel("output tokens / s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Throughput per system (same run, identical work)")


def _timeline_pair(reports: list[WorkloadReport]) -> tuple[str, SystemResult, SystemResult] | None:
    """The first workload where both native and native_sync reported a busy timeline (warm runs preferred)."""
    for report in reports:
        ordered = sorted(report.results, key=lambda r: r.run == "warm")  # warm last: it wins below
        by_name = {r.system: r for r in ordered if r.busy_timeline}
        if "native" in by_name and "native_sync" in by_name:
            return report.requests.spec.name, by_name["native"], by_name["native_sync"]
    return None


def _timeline_panel(ax, workload: str, native: SystemResult, native_sync: SystemResult) -> None:
    for row, result in enumerate((native, native_sync)):
        spans = result.busy_timeline
        # A window from the middle of the run: steady-state decode, away from start-up and the tail.
        middle = spans[len(spans) // 2][0]
        end = middle + TIMELINE_WINDOW_S
        window = [(a, min(b, end)) for a, b in spans if middle <= a < end]
        ax.broken_barh([((a - middle) * 1e3, (b - a) * 1e3) for a, b in window], (row - 0.35, 0.7), color=f"C{row}")
        busy = _percent(result.gpu_busy_fraction)
        ax.text(TIMELINE_WINDOW_S * 1e3, row, f"  busy {busy} (whole run)", va="center", fontsize=8)
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["native", "native_sync"])
    ax.set_xlim(0, TIMELINE_WINDOW_S * 1e3 * 1.25)
    ax.set_xlabel(f"ms, from the middle of the run ({workload})")
    ax.set_title("GPU-busy timeline (compute intervals)")
