"""A query result as a markdown table and as a text bar chart: what `eagle3 sql --markdown`, the overview
report and the UI's markdown metadata print."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(value: Any) -> str:
    """One value as text: null as an empty cell, floats to 4 significant digits, lists joined."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "| " + " | ".join(columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join([head, rule, *body]) + "\n"


def bar_chart(
    title: str,
    bars: Sequence[tuple[str, float | None]],
    width: int = 40,
    unit: str = "",
    floor: float = 0.0,
) -> str:
    """A horizontal bar chart in a code block (renders the same in the UI, a terminal and a markdown file);
    bars start at `floor` (1.0 for acceptance lengths, which never go below it); a missing value is shown as
    such, not as a zero bar."""
    values = [v for _, v in bars if v is not None]
    top = max(values, default=floor) - floor
    label_w = max((len(label) for label, _ in bars), default=0)
    lines = [f"{title}", "```"]
    for label, v in bars:
        if v is None:
            lines.append(f"{label:<{label_w}}  (none)")
            continue
        n = min(width, max(0, round(width * (v - floor) / top))) if top > 0 else 0
        lines.append(f"{label:<{label_w}}  {'█' * n}{' ' * (width - n)}  {v:.4g}{unit}")
    lines.append("```")
    return "\n".join(lines) + "\n"
