"""The one table helper of the text and markdown views: rows of cells in aligned columns."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(rows: Sequence[Sequence[str]], right: Sequence[bool] = (), strip: bool = False) -> list[str]:
    """`rows` (the header first) as lines of columns two spaces apart, each as wide as its widest cell; a column
    whose `right` is true is right-aligned, the others left-aligned; `strip` drops the spaces ending a line."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i < len(right) and right[i] else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip() if strip else "  ".join(cells))
    return lines


def markdown_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """`rows` (the header first) as a markdown table."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    header, *body = rows
    return [line(header), "|" + "---|" * len(header), *map(line, body)]
