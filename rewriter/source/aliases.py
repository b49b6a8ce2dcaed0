"""Local aliases of a source API: ``attn = flash_attn_func`` then ``attn(q, k, v, causal=True)``.

A call through a name is ported like a direct call when the name resolves **unambiguously** to a
source API, which libcst's scope analysis proves (in the fast mode the file's semantic model answers
for local aliases, :meth:`~flashport.rewriter.source.semantic.SemanticModel.local_alias`, with
libcst's answers):

* the alias is one plain statement ``name = <source>`` (a single ``Name`` target; the value a name
  or attribute that resolves to a source API) directly in a function body or at module level;
* it is the only assignment of ``name`` in its scope (no rebinding, no ``global`` write from a
  function, no ``for``/``with``/walrus target of the same name), and the call's name resolves to
  that assignment alone.

When every use of a function-local alias is such a call and all of them were rewritten, the
alias statement is removed (its comments move to the next statement), so the GPU import can go.
Otherwise it stays (module-level aliases always do: another module may import them; their calls in
this file are still ported), and where the rule has a drop-in that replicates the API exactly its
value becomes that drop-in (``attn = flashport.integrations.flash_attn_compat.flash_attn_func``), so
the calls that were not ported and every importer run on flashport too -- unless a call through it
was suppressed. A module-level alias whose every read is a ported call also gets a drop-in that
only replicates calls (SDPA's: :func:`flashport.rules.common.values.call_drop_in`), for its importers. Attributes (``self.fn = flash_attn_func``), dispatch tables and
``functools.partial`` are not aliases: their calls cannot be resolved, so the value itself goes to
the drop-in or is reported with the reason (:mod:`flashport.rules.common.values`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import libcst as cst

from flashport.rules.base import Rewrite, Rule


@dataclasses.dataclass
class Alias:
    """One alias statement and what happened to the calls through it.

    Attributes:
      name: the alias.
      api: the source API it stands for; ``rule`` answers for it.
      rule: the rule object.
      statement: the original ``SimpleStatementLine``; ``owner`` the original function/module
        whose body holds it; ``target`` the original ``Name`` target.
      where: (line, column, end line) of the alias value in the file.
      uses: how many times the alias is read (libcst ``Assignment.references``).
      rewritten: calls through it that were rewritten; ``calls``: calls through it asked about.
      own_reason: the rule's own reason for keeping this value (its ``check_reference``), if any.
      drop_in: the rule's rewrite of the value to flashport's drop-in, if it has one; a kept alias
        gets it as its value. ``suppressed``: calls through it kept by a ``# flashport: ignore``
        (the alias then keeps its value, or they would reach the drop-in).
    """

    name: str
    api: str
    rule: Rule
    statement: cst.SimpleStatementLine
    owner: cst.CSTNode
    target: cst.Name
    where: tuple[int, int, int]
    uses: int
    calls: int = 0
    rewritten: int = 0
    own_reason: str = ""
    drop_in: Rewrite | None = None
    suppressed: int = 0

    @property
    def local(self) -> bool:
        """Bound in a function (not visible to other modules)."""
        return isinstance(self.owner, cst.FunctionDef)

    def removable(self) -> bool:
        """Every read of a function-local alias is a call that was rewritten."""
        return self.local and self.uses > 0 and self.rewritten == self.uses

    def only_ported_calls(self) -> bool:
        """A module-level alias whose every read in the file is a call that was ported (none
        suppressed): only importers in other modules still reach its value."""
        return (
            not self.local
            and self.uses > 0
            and self.calls == self.uses == self.rewritten
            and not self.suppressed
        )

    def reason(self) -> str:
        """Why the alias statement stays (for its site)."""
        if not self.local:
            values = (
                f"; {self.uses - self.calls} of its {self.uses} reads here are not calls"
                if self.calls < self.uses
                else ""
            )
            return (
                f"module-level alias {self.name} = {self.api.rsplit('.', 1)[-1]} kept: another module may import it "
                f"({self.rewritten} of {self.calls} calls through it in this file were ported{values})"
            )
        if self.calls < self.uses:
            return (
                f"alias {self.name} is also used as a value ({self.uses - self.calls} of {self.uses} uses are not "
                "calls): kept, not rewritten"
            )
        return f"alias {self.name} kept: {self.calls - self.rewritten} of {self.calls} calls through it were not ported"


def candidate(
    assign: cst.Assign, ancestors: tuple[cst.CSTNode, ...]
) -> tuple[cst.Name, cst.SimpleStatementLine, cst.CSTNode] | None:
    """(target, statement, owner) when ``assign`` has the shape of an alias statement.

    ``ancestors`` are the original parents of ``assign``, nearest first.
    """
    if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
        return None
    if (
        len(ancestors) < 2
        or not isinstance(ancestors[0], cst.SimpleStatementLine)
        or len(ancestors[0].body) != 1
    ):
        return None
    statement, up = ancestors[0], ancestors[1]
    if isinstance(up, cst.Module):
        return assign.targets[0].target, statement, up
    if isinstance(up, cst.IndentedBlock) and len(ancestors) > 2 and isinstance(ancestors[2], cst.FunctionDef):
        return assign.targets[0].target, statement, ancestors[2]
    return None


def single_assignment(scope, target: cst.Name):
    """libcst's ``Assignment`` for ``target`` when it is the only binding of the name in its scope."""
    if scope is None:
        return None
    found = [a for a in scope.assignments[target.value] if getattr(a, "node", None) is target]
    if len(found) != 1 or len(scope.assignments[target.value]) != 1:
        return None
    return found[0]


def referent(scope, name: cst.Name):
    """The single assignment ``name`` (a read) resolves to, or None when it is not exactly one."""
    if scope is None:
        return None
    for access in scope.accesses[name.value]:
        if access.node is name:
            referents = list(access.referents)
            return referents[0] if len(referents) == 1 else None
    return None


def drop_statement(
    body: Sequence[cst.BaseStatement],
    original_body: Sequence[cst.BaseStatement],
    statement: cst.SimpleStatementLine,
    value: cst.BaseExpression | None = None,
) -> tuple[cst.BaseStatement, ...] | None:
    """``body`` without the statement at ``statement``'s position in ``original_body`` (its leading
    comments move to the next statement), or with ``value`` as that statement's assigned value when
    given; None when it cannot be located safely."""
    index = next((i for i, s in enumerate(original_body) if s is statement), None)
    if index is None or len(body) != len(original_body):
        return None
    if not body[index].deep_equals(statement):
        return None
    if value is not None:
        assign = statement.body[0]
        if not isinstance(assign, cst.Assign):
            return None
        changed = statement.with_changes(body=[assign.with_changes(value=value)])
        return (*body[:index], changed, *body[index + 1 :])
    if index + 1 >= len(body):
        return None
    following = body[index + 1]
    if not isinstance(following, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        return None
    moved = following.with_changes(leading_lines=(*statement.leading_lines, *following.leading_lines))
    return (*body[:index], moved, *body[index + 2 :])
