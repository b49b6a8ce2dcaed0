"""Value types the engine returns: one :class:`Site` per finding, one :class:`FileResult` per file.

Results are plain, picklable values (they cross process boundaries); the report layer renders them.
"""

from __future__ import annotations

import dataclasses

# Site statuses.
REWRITE = "rewrite"  # rewritten (or would be, in a dry run)
AS_IS = "as_is"  # left byte-identical because it runs with the same meaning on a TPU host
REFUSED = "refused"  # left byte-identical; ``reason`` says why
SUPPRESSED = "suppressed"  # a ``# flashport: ignore[...]`` comment (or the interactive review) skips it
SITE_STATUSES = (REWRITE, AS_IS, REFUSED, SUPPRESSED)
# Column headings of the statuses in every report (text, HTML, SARIF).
STATUS_LABELS = {REWRITE: "rewritten", AS_IS: "as is", REFUSED: "refused", SUPPRESSED: "suppressed"}

# File statuses.
UNCHANGED = "unchanged"
CHANGED = "changed"
ERROR = "error"
FILE_STATUSES = (UNCHANGED, CHANGED, ERROR)


@dataclasses.dataclass(frozen=True)
class Site:
    """One GPU attention use found in a file.

    Attributes:
      path: file path as given/discovered.
      line, column: 1-based line and 0-based column of the node's start.
      end_line: 1-based line where the node ends.
      rule: rule code (``FPA001``).
      api: qualified source API name (or the string value for config findings).
      kind: ``call``, ``reference`` (used as a value) or ``string`` (config value).
      status: one of :data:`SITE_STATUSES`.
      reason: why it was refused/suppressed/reported ("" for rewrites).
      notes: what a rewrite dropped or assumed (e.g. "dropped deterministic").
    """

    path: str
    line: int
    column: int
    end_line: int
    rule: str
    api: str
    kind: str
    status: str
    reason: str = ""
    notes: tuple[str, ...] = ()


@dataclasses.dataclass
class FileResult:
    """What the engine did with one file.

    Attributes:
      path: the file.
      status: one of :data:`FILE_STATUSES`.
      sites: findings in source order.
      old: original bytes (only kept when the file changed, for diffs/writes).
      new: rewritten bytes, or None when unchanged.
      error: one-line error for ``status == "error"`` (syntax error, undecodable, internal).
      parsed: whether the file passed the byte prefilter and was parsed.
      imports_added / imports_removed: import edits made (for the report).
      imports_kept: ``"<module> (line N): <reason>"`` for each GPU import a rewrite left in place (N:
        its line in the rewritten file)
        (:mod:`flashport.rewriter.imports.kept_imports`).
      size: the file's size in bytes.
      seconds: how long the engine took on it (0 when it was not parsed).
    """

    path: str
    status: str = UNCHANGED
    sites: list[Site] = dataclasses.field(default_factory=list)
    old: bytes | None = None
    new: bytes | None = None
    error: str | None = None
    parsed: bool = False
    imports_added: list[str] = dataclasses.field(default_factory=list)
    imports_removed: list[str] = dataclasses.field(default_factory=list)
    imports_kept: list[str] = dataclasses.field(default_factory=list)
    size: int = 0
    seconds: float = 0.0
