"""``flashport rewrite --report report.html``: one self-contained HTML page for reviewing a rewrite.

The page holds everything inline (CSS, no scripts, no fonts, no network): a summary table (files,
sites per rule and status), a table of the refused sites with their reasons, failed files, and per
file a unified diff with Python syntax colour (pygments, which rich already depends on) plus the
file's findings. Every path in the summary links to its file's section.

The input is the engine's result values (:class:`~flashport.rewriter.engine.results.FileResult`); counts come
from :func:`flashport.rewriter.app.report.summarize`, so the page and ``--format json`` always agree.
"""

from __future__ import annotations

import difflib
import html
import os
from collections.abc import Sequence

from flashport.rewriter.app import report as rep
from flashport.rewriter.engine.results import (
    AS_IS,
    CHANGED,
    ERROR,
    REFUSED,
    REWRITE,
    SITE_STATUSES,
    STATUS_LABELS,
    FileResult,
)
from flashport.rewriter.source import text as src

_CONTEXT = 3
_LABEL = STATUS_LABELS

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;padding:1.5em 2em;color:#1f2328;background:#fff}
h1{font-size:1.5em;margin:0 0 .3em} h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
h3{font-size:1.05em;margin:1.4em 0 .4em;font-family:ui-monospace,Menlo,Consolas,monospace}
.meta{color:#59636e;margin-bottom:1em}
table.t{border-collapse:collapse;margin:.4em 0 1em} table.t th,table.t td{border:1px solid #d0d7de;padding:.25em .6em;text-align:left;vertical-align:top}
table.t th{background:#f6f8fa} td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#1a7f37;font-weight:600} .bad{color:#cf222e;font-weight:600} .dim{color:#59636e}
.badge{display:inline-block;padding:0 .5em;border-radius:1em;font-size:.85em;font-weight:600}
.b-changed{background:#dafbe1;color:#1a7f37} .b-unchanged{background:#eaeef2;color:#59636e} .b-error{background:#ffebe9;color:#cf222e}
.s-rewrite{color:#1a7f37} .s-as_is{color:#0969da} .s-refused{color:#cf222e} .s-suppressed{color:#59636e}
table.diff{border-collapse:collapse;width:100%;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;border:1px solid #d0d7de}
table.diff td{padding:0 .5em;white-space:pre;vertical-align:top}
table.diff td.ln{color:#8c959f;text-align:right;width:1%;user-select:none;border-right:1px solid #d0d7de}
table.diff td.sg{width:1%;user-select:none}
tr.add{background:#e6ffec} tr.add td.sg{color:#1a7f37} tr.del{background:#ffebe9} tr.del td.sg{color:#cf222e}
tr.hunk td{background:#ddf4ff;color:#59636e}
ul.notes{margin:.3em 0 .8em}
a{color:#0969da;text-decoration:none} a:hover{text-decoration:underline}
"""


def render(
    results: Sequence[FileResult],
    *,
    title: str = "flashport rewrite report",
    mode: str = "dry-run",
    written: set[str] | frozenset[str] = frozenset(),
) -> str:
    """Return the report page for ``results`` as one HTML string.

    Args:
      results: the engine's per-file results (any order; shown as given).
      title: the page title.
      mode: ``dry-run``, ``write`` or ``check`` (shown in the header).
      written: paths that were written (marked in the summary).

    Returns:
      A complete, self-contained HTML document.
    """
    from pygments.formatters import HtmlFormatter

    info = rep.summarize(results)
    shown = [r for r in results if r.status != "unchanged" or r.sites]
    anchors = {r.path: f"file-{i}" for i, r in enumerate(shown)}
    css = _CSS + HtmlFormatter(style="default").get_style_defs(".hl") + "\ntd.hl{background:transparent}\n"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{css}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<div class="meta">mode: <b>{_e(mode)}</b> · {info["files_scanned"]} files scanned, '
        f"{info['files_parsed']} parsed, {info['files_changed']} changed, {info['files_failed']} failed · "
        "sites: "
        + ", ".join(f"{count} {_LABEL.get(status, status)}" for status, count in info["sites"].items())
        + "</div>",
    ]
    parts += _summary(info, shown, anchors, written)
    parts += _refused(results, anchors)
    parts += _failed(results, anchors)
    parts.append("<h2>Files</h2>")
    for result in shown:
        parts += _file_section(result, anchors[result.path], result.path in written)
    if not shown:
        parts.append('<p class="dim">no GPU attention uses found</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write(path: str, results: Sequence[FileResult], **kwargs) -> None:
    """Write :func:`render`'s page to ``path`` (UTF-8; the folder must exist)."""
    page = render(results, **kwargs)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(page)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------- sections


def _summary(info: dict, shown: Sequence[FileResult], anchors: dict, written) -> list[str]:
    out = ["<h2>Summary</h2>", '<table class="t" id="summary"><tr><th>rule</th>']
    out += [f"<th>{_LABEL.get(s, s)}</th>" for s in SITE_STATUSES]
    out.append("</tr>")
    for code, counts in info["rules"].items():
        out.append(
            f"<tr><td>{_e(code)}</td>"
            + "".join(f'<td class="n">{counts[s]}</td>' for s in SITE_STATUSES)
            + "</tr>"
        )
    total = info["sites"]
    out.append(
        "<tr><th>total</th>"
        + "".join(f'<th class="n">{total[s]}</th>' for s in SITE_STATUSES)
        + "</tr></table>"
    )
    out.append(
        '<table class="t" id="files"><tr><th>file</th><th>status</th><th>rewritten</th><th>as is</th><th>refused</th><th>imports</th></tr>'
    )
    for result in shown:
        counts = {s: sum(site.status == s for site in result.sites) for s in SITE_STATUSES}
        status = result.status + (" (written)" if result.path in written else "")
        imports = ", ".join(
            [f"+{m}" for m in result.imports_added]
            + [f"-{m}" for m in result.imports_removed]
            + [f"kept {m}" for m in result.imports_kept]
        )
        out.append(
            f'<tr><td><a href="#{anchors[result.path]}">{_e(result.path)}</a></td>'
            f'<td><span class="badge b-{result.status}">{_e(status)}</span></td>'
            f'<td class="n">{counts[REWRITE]}</td><td class="n">{counts[AS_IS]}</td>'
            f'<td class="n">{counts[REFUSED]}</td><td>{_e(imports)}</td></tr>'
        )
    out.append("</table>")
    if info["refused_reasons"]:
        out.append(
            '<table class="t" id="reasons"><tr><th>count</th><th>rule</th><th>not rewritten because</th></tr>'
        )
        for row in info["refused_reasons"]:
            out.append(
                f'<tr><td class="n">{row["count"]}</td><td>{_e(row["rule"])}</td><td>{_e(row["reason"])}</td></tr>'
            )
        out.append("</table>")
    return out


def _refused(results: Sequence[FileResult], anchors: dict) -> list[str]:
    rows = [(r, s) for r in results for s in r.sites if s.status == REFUSED]
    if not rows:
        return []
    out = [
        "<h2>Refused sites</h2>",
        '<table class="t" id="refused"><tr><th>location</th><th>rule</th><th>api</th><th>reason</th></tr>',
    ]
    for result, site in rows:
        out.append(
            f'<tr><td><a href="#{anchors[result.path]}">{_e(site.path)}:{site.line}</a></td><td>{_e(site.rule)}</td>'
            f"<td><code>{_e(site.api)}</code></td><td>{_e(site.reason)}</td></tr>"
        )
    out.append("</table>")
    return out


def _failed(results: Sequence[FileResult], anchors: dict) -> list[str]:
    failed = [r for r in results if r.status == ERROR]
    if not failed:
        return []
    out = ["<h2>Files that could not be processed</h2>", '<ul id="failed">']
    out += [
        f'<li><a href="#{anchors[r.path]}">{_e(r.path)}</a>: <span class="bad">{_e(r.error or "")}</span></li>'
        for r in failed
    ]
    out.append("</ul>")
    return out


def _file_section(result: FileResult, anchor: str, written: bool) -> list[str]:
    out = [
        f'<section id="{anchor}"><h3>{_e(result.path)} <span class="badge b-{result.status}">{_e(result.status)}'
        f"{' (written)' if written else ''}</span></h3>"
    ]
    if result.error:
        out.append(f'<p class="bad">{_e(result.error)}</p>')
    if result.sites:
        out.append('<ul class="notes">')
        for site in result.sites:
            why = site.reason or "; ".join(site.notes)
            out.append(
                f'<li><span class="s-{site.status}">{site.status}</span> line {site.line} {_e(site.rule)} '
                f"<code>{_e(site.api)}</code>{': ' + _e(why) if why else ''}</li>"
            )
        out.append("</ul>")
    if result.status == CHANGED and result.old is not None and result.new is not None:
        out.append(_diff_table(result.old, result.new))
    out.append('<p><a href="#summary">↑ summary</a></p></section>')
    return out


# ----------------------------------------------------------------------------------- diffs


def _diff_table(old: bytes, new: bytes) -> str:
    """A unified diff as an HTML table: old/new line numbers, sign, highlighted code."""
    old_text, new_text = _decode(old), _decode(new)
    old_lines, new_lines = src.split_lines(old_text), src.split_lines(new_text)
    old_html, new_html = highlight_lines(old_text), highlight_lines(new_text)
    rows = ['<table class="diff">']
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for group in matcher.get_grouped_opcodes(_CONTEXT):
        first, last = group[0], group[-1]
        rows.append(
            f'<tr class="hunk"><td class="ln"></td><td class="ln"></td><td class="sg"></td>'
            f"<td>@@ -{first[1] + 1},{last[2] - first[1]} +{first[3] + 1},{last[4] - first[3]} @@</td></tr>"
        )
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                for i, j in zip(range(i1, i2), range(j1, j2), strict=False):
                    rows.append(_row("ctx", i + 1, j + 1, " ", new_html[j]))
                continue
            for i in range(i1, i2):
                rows.append(_row("del", i + 1, "", "-", old_html[i]))
            for j in range(j1, j2):
                rows.append(_row("add", "", j + 1, "+", new_html[j]))
    rows.append("</table>")
    return "\n".join(rows)


def _row(kind: str, old_no, new_no, sign: str, code: str) -> str:
    return (
        f'<tr class="{kind}"><td class="ln">{old_no}</td><td class="ln">{new_no}</td>'
        f'<td class="sg">{sign}</td><td class="hl">{code}</td></tr>'
    )


def highlight_lines(text: str) -> list[str]:
    """Python-highlight ``text`` and return one HTML fragment per line of :func:`source.split_lines`.

    The whole text is lexed at once (so multi-line strings colour correctly) and the token stream is
    cut at line endings; each fragment is a run of ``<span class="...">`` elements without the
    line ending.
    """
    from pygments.lexers import PythonLexer
    from pygments.token import STANDARD_TYPES

    lines: list[list[str]] = [[]]
    lexer = PythonLexer(stripnl=False, ensurenl=False)
    for token, value in lexer.get_tokens(text.replace("\r\n", "\n").replace("\r", "\n")):
        css = _css_class(token, STANDARD_TYPES)
        for k, piece in enumerate(value.split("\n")):
            if k:
                lines.append([])
            if piece:
                lines[-1].append(f'<span class="{css}">{_e(piece)}</span>' if css else _e(piece))
    expected = len(src.split_lines(text))
    fragments = ["".join(parts) for parts in lines]
    if len(fragments) > expected:  # a trailing newline opens an empty last line
        fragments = fragments[:expected]
    fragments += [""] * (expected - len(fragments))
    return fragments


def _css_class(token, standard) -> str:
    while token not in standard:
        token = token.parent
    return standard[token]


def _decode(data: bytes) -> str:
    try:
        return src.decode(data)[0]
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return data.decode("utf-8", "replace")


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
