"""The evaluation as a person reads it: a summary table, a per-case table and a plot of Dice and HD95 per
structure (evaluation.html + evaluation.png), also embedded in a run's report.html."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from bigmem_train.verdict.figures import pyplot, save_figure


def plot_evaluation(result: dict[str, Any], path: Path) -> Path | None:
    """Per structure: every case's Dice and HD95 as points over a box (evaluation.png)."""
    structures = list(result.get("summary", {}))
    if not structures:
        return None
    plt = pyplot()
    figure, (dice_axes, hd_axes) = plt.subplots(1, 2, figsize=(11, 3.8))
    for axes, key, label in ((dice_axes, "dice", "Dice"), (hd_axes, "hd95_mm", "HD95 (mm)")):
        values = [[case[key] for case in result["cases"] if case["structure"] == name] for name in structures]
        axes.boxplot(values, showfliers=False)
        for index, points in enumerate(values, start=1):
            axes.scatter([index] * len(points), points, s=12, alpha=0.6)
        axes.set_xticks(range(1, len(structures) + 1), structures, rotation=20)
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    dice_axes.set_ylim(-0.02, 1.02)
    hd_axes.set_ylim(bottom=0)
    figure.suptitle(f"{len({case['case'] for case in result['cases']})} case(s)")
    return save_figure(plt, figure, path)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) <= 1 else f"{value:.2f}"
    return html.escape(str(value))


def evaluation_tables(result: dict[str, Any]) -> str:
    """The summary and per-case tables as HTML (no page around them)."""
    summary_rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{row['cases']}</td><td>{row['mean_dice']:.4f}</td>"
        f"<td>{row['median_dice']:.4f}</td><td>{row['pooled_dice']:.4f}</td><td>{row['mean_hd95_mm']:.2f}</td>"
        f"<td>{row['median_hd95_mm']:.2f}</td></tr>"
        for name, row in result.get("summary", {}).items()
    )
    case_rows = "".join(
        f"<tr><td>{html.escape(case['case'])}</td><td>{html.escape(case['structure'])}</td>"
        f"<td>{_cell(case['dice'])}</td><td>{case['hd95_mm']:.2f}</td><td>{case['predicted_ml']:.2f}</td>"
        f"<td>{case['true_ml']:.2f}</td></tr>"
        for case in result.get("cases", [])
    )
    return (
        "<table><tr><th>structure</th><th>cases</th><th>mean Dice</th><th>median Dice</th><th>pooled Dice</th>"
        f"<th>mean HD95 (mm)</th><th>median HD95 (mm)</th></tr>{summary_rows}</table>"
        f"<p>Empty masks: {html.escape(result.get('convention', ''))}.</p>"
        "<details><summary>per case</summary><table><tr><th>case</th><th>structure</th><th>Dice</th>"
        f"<th>HD95 (mm)</th><th>predicted (mL)</th><th>true (mL)</th></tr>{case_rows}</table></details>"
    )


def write_evaluation_html(result: dict[str, Any], out_dir: Path) -> Path:
    image = plot_evaluation(result, out_dir / "evaluation.png")
    figure = f'<img src="{image.name}" alt="Dice and HD95 per structure">' if image else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>bigmem-train evaluation</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}td,th{{text-align:left;padding-right:1.5em}}
img{{max-width:100%;margin:1em 0}}</style></head>
<body><h1>Evaluation</h1>
<p>Predictions <code>{html.escape(str(result.get("predictions", "")))}</code> against labels
<code>{html.escape(str(result.get("labels", "")))}</code>.</p>
{evaluation_tables(result)}
{figure}
</body></html>
"""
    path = out_dir / "evaluation.html"
    path.write_text(page)
    return path
