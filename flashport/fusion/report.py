"""What :func:`flashport.find_attention` returns: sites as data, rendered as a rich table."""

from __future__ import annotations

import dataclasses

COLUMNS = (
    "status",
    "where",
    "location",
    "q",
    "k",
    "v",
    "layout",
    "scale",
    "mask",
    "softcap",
    "dtypes",
    "gqa",
    "empty_rows",
    "reason",
)


@dataclasses.dataclass(frozen=True)
class Site:
    """One attention site: ``status`` is ``"fused"`` or ``"near-miss"`` (then ``reason`` says why)."""

    status: str
    where: str
    location: str
    q: tuple | None = None
    k: tuple | None = None
    v: tuple | None = None
    layout: str = ""
    scale: float | None = None
    mask: str = ""
    softcap: float | None = None
    dtypes: str = ""
    gqa: int | None = None
    empty_rows: str = ""
    reason: str = ""

    def as_dict(self) -> dict:
        """Plain data (JSON-friendly)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AttentionReport:
    """All matches and near-misses of one traced program."""

    sites: tuple

    @property
    def matches(self) -> list:
        """Sites that :func:`flashport.fuse_attention` rewrites."""
        return [s for s in self.sites if s.status == "fused"]

    @property
    def near_misses(self) -> list:
        """Attention-like sites left alone, each with its reason."""
        return [s for s in self.sites if s.status != "fused"]

    def to_dicts(self) -> list:
        """Every site as a plain dict."""
        return [s.as_dict() for s in self.sites]

    def table(self):
        """A :class:`rich.table.Table` of every site."""
        from rich.table import Table

        table = Table(
            title=f"flashport.find_attention: {len(self.matches)} fused, {len(self.near_misses)} near-miss"
        )
        for col in COLUMNS:
            table.add_column(col, overflow="fold")
        for s in self.sites:
            row = s.as_dict()
            table.add_row(*("" if row[c] is None else _fmt(row[c]) for c in COLUMNS))
        return table

    def __rich__(self):
        return self.table()

    def __str__(self):
        from rich.console import Console

        console = Console(width=200, record=True, file=_Null())
        console.print(self.table())
        return console.export_text()

    def __len__(self):
        return len(self.sites)


def site_from(plan, item, status) -> Site:
    """Build a :class:`Site` from a match or a near-miss found in ``plan``."""
    info = item.info
    where = plan.path or "<top>"
    if status == "near-miss":
        return Site(
            status=status,
            where=where,
            location=info["location"],
            dtypes=info.get("dtype", ""),
            reason=item.reason,
            q=None,
            layout=f"scores{list(info['scores_shape'])}",
        )
    return Site(
        status=status,
        where=where,
        location=info["location"],
        q=info["q_shape"],
        k=info["k_shape"],
        v=info["v_shape"],
        layout=info["layout"],
        scale=float(info["scale"]),
        mask=info["mask"],
        softcap=info["softcap"],
        dtypes=info["dtypes"] + f" (softmax {info['softmax_dtype']})",
        gqa=info["gqa"],
        empty_rows=info["empty_rows"],
    )


def _fmt(x):
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


class _Null:
    def write(self, _):
        return 0

    def flush(self):
        pass
