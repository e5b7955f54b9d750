"""A report a person can open: report.html with PNG plots (memory over time, loss and Dice per epoch)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from bigmem_train.errors import BadInput
from bigmem_train.memory.constants import ended_span
from bigmem_train.sizes import GIB, format_bytes
from bigmem_train.verdict.evaluation_report import evaluation_tables, plot_evaluation
from bigmem_train.verdict.figures import pyplot, save_figure
from bigmem_train.verdict.rundir import read_history, read_memory_csv


def _plot_memory(run_dir: Path, metrics: dict) -> Path | None:
    plt = pyplot()
    memory = read_memory_csv(run_dir / "memory.csv")
    if not memory:
        return None
    start = memory[0]["time_unix"]
    times = [row["time_unix"] - start for row in memory]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.plot(times, [row["rss_bytes"] / GIB for row in memory], label="resident (RSS)")
    axis.plot(
        times, [row.get("anon_hugepages_bytes", 0) / GIB for row in memory], label="of which THP", alpha=0.7
    )
    if "rss_file_bytes" in memory[0]:
        axis.plot(
            times,
            [row.get("rss_file_bytes", 0) / GIB for row in memory],
            label="of which file-backed",
            alpha=0.7,
        )
    if metrics.get("memory_measure", "rss") != "rss":
        axis.plot(
            times, [row.get("working_set_bytes", 0) / GIB for row in memory], label="cgroup working set"
        )
    for key in memory[0]:
        if key.startswith("node") and key.endswith("_bytes"):
            axis.plot(times, [row.get(key, 0) / GIB for row in memory], label=key[:-6], linestyle=":")
    if metrics.get("planned_peak_bytes"):
        axis.axhline(
            metrics["planned_peak_bytes"] / GIB, color="tab:red", linestyle="--", label="planned peak"
        )
    if metrics.get("target_bytes"):
        axis.axhline(metrics["target_bytes"] / GIB, color="black", linestyle="-.", label="target")
    axis.set_xlabel("seconds since start")
    axis.set_ylabel("GiB")
    axis.set_title("Memory over time")
    axis.legend(loc="lower right")
    axis.grid(alpha=0.3)
    return save_figure(plt, figure, run_dir / "memory.png")


def _plot_training(run_dir: Path) -> Path | None:
    plt = pyplot()
    history = read_history(run_dir / "history.csv")
    if not history:
        return None
    epochs = [int(row.get("epoch", index)) + 1 for index, row in enumerate(history)]
    figure, (loss_axis, dice_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for key, axis in (
        ("loss", loss_axis),
        ("val_loss", loss_axis),
        ("dice", dice_axis),
        ("val_dice", dice_axis),
        ("val_hard_dice", dice_axis),
    ):
        if key in history[0]:
            axis.plot(epochs, [row.get(key) for row in history], marker="o", label=key)
    loss_axis.set_title("Loss per epoch")
    dice_axis.set_title("Dice per epoch")
    dice_axis.set_ylim(0, 1)
    for axis in (loss_axis, dice_axis):
        axis.set_xlabel("epoch")
        axis.legend()
        axis.grid(alpha=0.3)
    return save_figure(plt, figure, run_dir / "training.png")


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _gib(value) -> str:
    return f"{value / GIB:,.2f} GiB" if isinstance(value, (int, float)) else "-"


def _planned_memory_rows(plan: dict, metrics: dict) -> str:
    """The plan's breakdown, rounded for a person, and the planned peak next to the measured one."""
    breakdown = plan.get("breakdown") or {}
    if not breakdown:
        return ""
    rows = ["<tr><th>component</th><th>planned</th><th>measured</th></tr>"]
    mapped = plan.get("runtime_file_backed") or {}
    for key, value in breakdown.items():
        planned = value.get("bytes") if isinstance(value, dict) else value  # plan.json: {bytes, gib}
        note = ""
        if key == "runtime_baseline" and mapped.get("measured_bytes"):
            # The one planned figure a run measures for itself (JobPlan.with_file_backed).
            note = f"of which mapped files {_gib(mapped['measured_bytes'])} at the start"
            if mapped.get("calibrated_bytes"):
                note += f" (calibration: {_gib(mapped['calibrated_bytes'])})"
        rows.append(
            f"<tr><td>{html.escape(key.replace('_', ' '))}</td><td>{_gib(planned)}</td>"
            f"<td>{html.escape(note)}</td></tr>"
        )
    planned_peak, measured_peak = plan.get("peak_bytes"), metrics.get("peak_rss_bytes")
    error = ""
    if planned_peak and measured_peak:
        error = f" ({(planned_peak - measured_peak) / measured_peak:+.1%} planned vs measured)"
    rows.append(f"<tr><th>peak</th><th>{_gib(planned_peak)}</th><th>{_gib(measured_peak)}{error}</th></tr>")
    stated = plan.get("expected_range") or {}
    if stated.get("low_bytes") and stated.get("high_bytes"):
        low, high = stated["below"]
        rows.append(
            f"<tr><td>expected range</td><td>{_gib(stated['low_bytes'])} to {_gib(stated['high_bytes'])}</td>"
            f"<td>the plan is the upper envelope of this kind of job's runs: {stated.get('runs', '?')} "
            f"calibration runs {ended_span(low, high)}; a run may end at most "
            f"{stated.get('coverage', 0.03):.0%} above it</td></tr>"
        )
    return "\n".join(rows)


def _measure_statement(metrics: dict) -> str:
    """Which memory the verdict's footprint check and the memory guard judge, and its peak."""
    measure = metrics.get("memory_measure")
    if not measure:
        return "resident memory (RSS)"
    peak = metrics.get("peak_measured_bytes")
    what = (
        "resident memory (RSS): no memory cgroup limit applied"
        if measure == "rss"
        else f"{measure} (charged to the run's cgroup less inactive page cache: what its limit acts on)"
    )
    return f"{what}; peak {format_bytes(peak)}" if peak else what


def write_report(run_dir: Path) -> Path:
    """Write RUN_DIR/report.html (and memory.png, training.png); returns the HTML path."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise BadInput(f"{run_dir} is not a bigmem-train run directory (no config.yaml)")
    metrics = _load(run_dir / "metrics.json")
    verdict = _load(run_dir / "verdict.json")
    plan = _load(run_dir / "plan.json")
    host = _load(run_dir / "host.json")
    images = [path for path in (_plot_memory(run_dir, metrics), _plot_training(run_dir)) if path]

    def size(value):
        return format_bytes(value) if isinstance(value, (int, float)) and value else "-"

    rows = [
        ("Verdict", verdict.get("verdict", "not validated")),
        ("Input shape x batch", f"{metrics.get('input_shape')} x {metrics.get('batch_size')}"),
        ("Judged memory measure", _measure_statement(metrics)),
        ("Peak resident memory (RSS)", size(metrics.get("peak_rss_bytes"))),
        ("Of which file-backed at the peak", size(metrics.get("file_backed_at_peak_bytes"))),
        (
            "Peak cgroup working set / charge",
            f"{size(metrics.get('peak_cgroup_working_set_bytes'))} / "
            f"{size(metrics.get('peak_cgroup_charged_bytes'))}",
        ),
        ("Planned peak", size(metrics.get("planned_peak_bytes"))),
        ("Target", size(metrics.get("target_bytes"))),
        ("Median step time", _rounded(metrics.get("median_step_seconds"), 2, " s")),
        ("Voxels per second", _voxels_per_second(metrics.get("voxels_per_second"))),
        (
            "Loss (first -> last epoch)",
            f"{_rounded(metrics.get('initial_loss'), 4)} -> {_rounded(metrics.get('final_loss'), 4)}",
        ),
        (
            "Best validation Dice (soft / hard)",
            f"{_rounded(metrics.get('best_val_dice'), 3)} / {_rounded(metrics.get('best_val_hard_dice'), 3)}",
        ),
        ("Transparent huge pages at peak", size(metrics.get("peak_anon_hugepages_bytes"))),
        ("NUMA policy", metrics.get("numa_policy")),
        (
            "Threads (intra / inter)",
            f"{metrics.get('intra_op_threads')} / {_inter_op(metrics.get('inter_op_threads'))}",
        ),
        (
            "TensorFlow / oneDNN",
            f"{metrics.get('tensorflow_version')} / {'on' if metrics.get('onednn_enabled') else 'off'}",
        ),
        ("Intel-optimized (oneDNN on)", metrics.get("intel_optimized")),
        (
            "Host",
            f"{host.get('hostname', '?')}: {size(host.get('memory_total_bytes'))} total, "
            f"{host.get('physical_cores', '?')} cores, {len(host.get('numa_nodes', []))} NUMA nodes",
        ),
    ]
    table = "\n".join(
        f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(str(value))}</td></tr>" for key, value in rows
    )
    criteria = "\n".join(
        f"<li class={'ok' if item['passed'] else 'fail'}>{'&#10003;' if item['passed'] else '&#10007;'} "
        f"<b>{html.escape(item['name'])}</b>: {html.escape(item['detail'])}</li>"
        for item in verdict.get("criteria", [])
    )
    breakdown = _planned_memory_rows(plan, metrics)
    figures = "\n".join(f'<img src="{path.name}" alt="{path.stem}">' for path in images)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>bigmem-train run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}th{{text-align:left;padding-right:2em}}
.ok{{color:#176017}}.fail{{color:#a11}}img{{max-width:100%;margin:1em 0}}</style></head>
<body><h1>bigmem-train run <code>{html.escape(run_dir.name)}</code>: {html.escape(verdict.get("verdict", "not validated"))}</h1>
<h2>Criteria</h2><ul>{criteria or "<li>not validated yet: run bigmem-train validate</li>"}</ul>
<h2>Key figures</h2><table>{table}</table>
<h2>Planned memory</h2><table>{breakdown or "<tr><td>no plan recorded</td></tr>"}</table>
{_evaluation_section(run_dir)}
<h2>Plots</h2>{figures}
</body></html>
"""
    path = run_dir / "report.html"
    path.write_text(page)
    return path


def _evaluation_section(run_dir: Path) -> str:
    """The best checkpoint on the whole validation volumes (RUN_DIR/evaluation/), when the run has it."""
    folder = run_dir / "evaluation"
    result = _load(folder / "evaluation.json")
    if not result.get("summary"):
        return ""
    image = folder / "evaluation.png"
    if not image.exists():
        plot_evaluation(result, image)
    figure = (
        f'<img src="evaluation/{image.name}" alt="Dice and HD95 per structure">' if image.exists() else ""
    )
    return (
        "<h2>The model on whole validation volumes</h2><p>The best checkpoint applied by "
        "<code>bigmem-train predict</code> to each validation case at full size and scored by "
        f"<code>bigmem-train evaluate</code> (evaluation/).</p>{evaluation_tables(result)}{figure}"
    )


def _rounded(value, digits: int, unit: str = "") -> str:
    """A float for a person: ``digits`` decimals (1.4693821668624878 -> 1.47); "-" when not recorded."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _voxels_per_second(value) -> str:
    """Voxels per second in millions with three significant figures (1344175.0 -> 1.34 M)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value / 1e6:.3g} M"


def _inter_op(threads) -> str:
    """The inter-op setting as a person reads it (-1: every op in the calling thread)."""
    return "inline (one op at a time)" if threads == -1 else str(threads)
