"""One HTML page of sections (a heading, how to read it, a figure, a table or text), with plotly.js once."""

from __future__ import annotations

import html
import re

import pandas as pd
import plotly.graph_objects as go

STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h2{margin-top:32px;border-bottom:1px solid #ddd}p.how{color:#555;margin:4px 0 8px}
table.summary{border-collapse:collapse}table.summary td,table.summary th{padding:4px 10px;text-align:right}
table.summary td:nth-child(-n+2),table.summary th:nth-child(-n+2){text-align:left}
table.summary tr:nth-child(even){background:#f4f6fa}div.wide{overflow-x:auto;max-width:100%}
table.summary{font-size:14px}"""


Section = tuple[str, str, "go.Figure | pd.DataFrame | str | None"]  # title, how to read it, content (str: text)


def page(title: str, runs_line: str, tracking_uri: str, sections: list[Section]) -> str:
    """An HTML page of `sections` (a missing content leaves its section out), with plotly.js once."""
    body, plotly_js = [], True
    for heading, how, content in sections:
        if content is None:
            continue
        if isinstance(content, str):
            shown = f"<pre>{html.escape(content)}</pre>"
        elif isinstance(content, pd.DataFrame):
            shown = f"<div class='wide'>{content.to_html(index=False, classes='summary', border=0)}</div>"
        else:
            shown = content.to_html(full_html=False, include_plotlyjs=plotly_js, config={"displaylogo": False})
            plotly_js = False
        body.append(f"<h2>{html.escape(heading)}</h2><p class='how'>{html.escape(how)}</p>{shown}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p class='how'>{html.escape(runs_line)}; tracking {html.escape(without_secrets(tracking_uri))}</p>"
            f"{''.join(body)}</body></html>")


def without_secrets(uri: str) -> str:
    """A store URI without the user and password it may carry (postgresql://user:pass@host/db)."""
    return re.sub(r"//[^/@]*@", "//", uri)
