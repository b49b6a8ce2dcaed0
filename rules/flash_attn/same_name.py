"""What the rules share whose every function has a drop-in of the same name and signature
(FPA015 rotary, FPA017 distributed collectives): a call, or a value, becomes flashport's drop-in
of the same name. :class:`SameNameRule` holds that; each rule module sets its manifest,
``DROP_IN_MODULE`` and ``DROP_IN_KIND``.
"""

from __future__ import annotations

from typing import ClassVar

from flashport.rules.base import Rewrite, Rule
from flashport.rules.common import values
from flashport.rules.common.calls import dotted, on_drop_in


class SameNameRule(Rule):
    """A call or value on flashport's drop-in of the same name (flash-attn's signature and result).

    Class attributes:
      DROP_IN_MODULE: the module holding the drop-ins.
      DROP_IN_KIND: what the drop-ins are built on, for the notes (``"plain torch"``).
    """

    DROP_IN_MODULE: ClassVar[str] = ""
    DROP_IN_KIND: ClassVar[str] = ""

    def check_call(self, call, ctx):
        """The same call on the drop-in of the same name."""
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        note = f"drop-in {name} (flash-attn's signature and result, {self.DROP_IN_KIND})"
        return on_drop_in(call, f"{self.DROP_IN_MODULE}.{name}", note)

    def check_reference(self, node, ctx):
        """A value is the drop-in of the same name unless it is probed or compared."""
        why = values.probe(ctx)
        if why is not None and not values.inspects_signature(ctx):
            return values.Report(f"{why}: not a call to port; kept")
        name = ctx.qualified_name.rsplit(".", 1)[-1]
        note = (
            f"{values.describe(node, ctx)}: the value is now flashport's drop-in "
            f"{self.DROP_IN_MODULE}.{name} (same signature)"
        )
        return Rewrite(self.drop_in(name), imports=(self.DROP_IN_MODULE,), notes=(note,))

    def drop_in(self, name: str):
        """The drop-in ``name`` of :attr:`DROP_IN_MODULE` as an expression."""
        return dotted(f"{self.DROP_IN_MODULE}.{name}")
