"""A cheaper libcst ``PositionProvider``: the same positions, stored as plain tuples.

libcst's ``PositionProvider`` renders the module once and records a ``CodeRange`` (two frozen
dataclasses) for every node, splitting every token with a regex to count lines. On a site-dense
file that is about as costly as the scope analysis. :class:`LinePositionProvider` runs the same
rendering with the same rules (syntactic positions, hoisted from child nodes where libcst hoists
them) but keeps ``((start_line, start_column), (end_line, end_column))`` tuples and only splits
tokens that hold a line break.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import libcst as cst
from libcst.metadata.base_provider import BaseMetadataProvider
from libcst.metadata.position_provider import NEWLINE_RE, PositionProvidingCodegenState

Span = tuple[tuple[int, int], tuple[int, int]]


class _TupleState(PositionProvidingCodegenState):
    """libcst's position-providing codegen state, recording tuples instead of ``CodeRange`` s."""

    __slots__ = ()

    def add_token(self, value: str) -> None:
        """Append ``value`` and advance the line/column counters."""
        self.tokens.append(value)
        if "\n" in value or "\r" in value:
            segments = NEWLINE_RE.split(value)
            self.line += len(segments) - 1
            self.column = len(segments[-1])
        else:
            self.column += len(value)

    def add_indent_tokens(self) -> None:
        """Append the current indentation (never holds a line break)."""
        for token in self.indent_tokens:
            self.add_token(token)

    def before_codegen(self, node: cst.CSTNode) -> None:
        """Remember where ``node`` starts."""
        self._stack.append((self.line, self.column))  # type: ignore[arg-type]  # tuples, not CodePosition

    def after_codegen(self, node: cst.CSTNode) -> None:
        """Record ``node``'s span unless its syntactic position is already known."""
        start = self._stack.pop()
        computed = self.provider._computed
        if node not in computed:
            computed[node] = (start, (self.line, self.column))

    @contextmanager
    def record_syntactic_position(
        self,
        node: cst.CSTNode,
        *,
        start_node: cst.CSTNode | None = None,
        end_node: cst.CSTNode | None = None,
    ) -> Iterator[None]:
        """Record ``node``'s span without surrounding whitespace (hoisted from children when given)."""
        start = (self.line, self.column)
        try:
            yield
        finally:
            computed: dict[cst.CSTNode, Span] = self.provider._computed  # type: ignore[assignment]
            end = computed[end_node][1] if end_node is not None else (self.line, self.column)
            if start_node is not None:
                start = computed[start_node][0]
            computed[node] = (start, end)


class LinePositionProvider(BaseMetadataProvider[Span]):
    """Per node ``((start_line, start_column), (end_line, end_column))``: 1-based lines, 0-based
    columns, exactly ``PositionProvider``'s ``start``/``end``."""

    def _gen_impl(self, module: cst.Module) -> None:
        state = _TupleState(
            default_indent=module.default_indent,
            default_newline=module.default_newline,
            provider=self,  # type: ignore[arg-type]  # same provider API, tuple values
        )
        module._codegen(state)


def line_positions(module: cst.Module) -> dict[cst.CSTNode, Span]:
    """:class:`LinePositionProvider`'s mapping for ``module``, computed directly: resolving it
    through a ``MetadataWrapper`` also runs libcst's batched-provider traversal of the whole
    module, with no batched provider to feed."""
    provider = LinePositionProvider()
    provider._gen_impl(module)
    return provider._computed  # type: ignore[return-value]  # tuples, as recorded by _TupleState
