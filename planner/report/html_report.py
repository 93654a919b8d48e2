"""The self-contained HTML report: one page with the traces' timelines side by side (stacked by category, zoomable,
every buffer's details on hover), the plans' address space, the largest buffers at the peak, a per-module table,
the GPU verdict and the commands that reproduce it. Data and script are embedded: it opens offline."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from importlib.resources import files

from memplan.planner.report.html_data import Marks, panel_data
from memplan.planner.report.plots import CATEGORY_COLORS, PHASE_COLORS, PLAN_COLOR, RESERVED_COLOR
from memplan.planner.report.verdict_text import render_verdict
from memplan.planner.simulate.measure import Measurement
from memplan.traces.format import CATEGORIES, PHASES

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:20px;margin:0 0 4px}h3{margin:4px 0}h4{margin:14px 0 4px}
#panels{display:grid;gap:16px;overflow-x:auto}
.panel{border:1px solid #ddd;border-radius:6px;padding:8px;min-width:0}
.plot{position:relative}canvas{width:100%;display:block;cursor:crosshair}
.sel{position:absolute;top:0;height:100%;background:rgba(70,110,200,.18);display:none;pointer-events:none}
#tip{position:absolute;display:none;background:#fff;border:1px solid #999;padding:6px 8px;font:12px monospace;
white-space:pre;pointer-events:none;box-shadow:0 2px 6px rgba(0,0,0,.2);z-index:9}
table{border-collapse:collapse;font-size:12px}
td,th{border-bottom:1px solid #eee;padding:2px 6px;text-align:left;white-space:nowrap}
.scroll{overflow-x:auto}
.stats,.note{color:#555;margin:2px 0}.legend span{margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}
"""


NOTE = (
    "Device memory over one training step: live bytes stacked by category (exact figures and the buffer under the "
    "pointer on hover), the caching allocator's reserved bytes, the plan's footprint and address space."
)


def embed_json(data: dict) -> str:
    """JSON safe inside a <script> element (no "</" to close it early)."""
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def render_html(
    reports: list[Measurement],
    commands: list[str],
    title: str = "memplan report",
    marks: Sequence[Marks | None] = (),
    note: str | None = None,
) -> str:
    """The whole page for `reports` (one panel each, on one scale, each with its `marks` when given) and the
    `commands` that reproduce it; `note` replaces the line that says what the timelines show."""
    panels = []
    for k, m in enumerate(reports):
        p = panel_data(m, marks[k] if k < len(marks) else None)
        p["verdict_text"] = None if p["verdict"] is None else render_verdict(p["verdict"])
        panels.append(p)
    present = {c for m in reports for c in m.trace.category}
    data = {
        "categories": list(CATEGORIES),
        "phases": list(PHASES),
        "colors": CATEGORY_COLORS,
        "phase_colors": PHASE_COLORS,
        "line_colors": {"reserved": RESERVED_COLOR, "plan": PLAN_COLOR},
        "present": [c for c in CATEGORIES if c in present],
        "panels": panels,
    }
    script = files("memplan.planner.report").joinpath("html_page.js").read_text(encoding="utf-8")
    reproduce = "\n".join(commands)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; \
style-src 'unsafe-inline'; img-src data:">
<style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="note">{html.escape(note or NOTE)}</p>
<div id="legend"></div>
<div id="panels"></div>
<h2>Reproduce</h2>
<pre id="commands">{html.escape(reproduce)}</pre>
<div id="tip"></div>
<pre id="selftest" hidden></pre>
<script type="application/json" id="data">{embed_json(data)}</script>
<script>{script}</script>
</body></html>
"""
