"""Parse the mini module piece by piece: the same libcst tree, cheaper on big inputs.

libcst's native parser costs more per byte the larger its input (a 1.3 MB module takes about
1.7x the time of the same statements parsed as a few hundred small modules). The mini module is a
sequence of independent top-level pieces -- the import header, each top-level chunk after its
sentinel comment, each stand-in class with its member chunks -- so :func:`parse` parses them
one by one and joins their statements into one ``Module``.

The joined tree is the tree ``cst.parse_module`` gives the whole text when:

* every piece detects the same ``default_indent`` and ``default_newline`` (libcst stores an
  indentation or a line ending only where it differs from the module's default, and the whole
  text's defaults are those of its first indented block and first line ending, i.e. of some
  piece);
* a piece's comment lines before its first statement (its ``header``: the sentinel comment) are
  that statement's ``leading_lines`` in the whole text (they sit at column 0 after the previous
  top-level statement, which owns no lines after its end), except in the first piece, where they
  are the module's header;
* no piece but the last has lines after its last statement (a ``footer``).

Otherwise :func:`parse` parses the whole text in one go.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst


def parse(pieces: Sequence[str]) -> cst.Module:
    """The libcst module of ``"".join(pieces)``, parsed piece by piece when that gives the same
    tree (see the module docstring), else in one go."""
    texts = [piece for piece in pieces if piece]
    modules = [cst.parse_module(text) for text in texts] if len(texts) > 1 else []
    if not modules or not _joinable(modules):
        return cst.parse_module("".join(pieces))
    first = modules[0]
    body: list[cst.BaseStatement] = list(first.body)
    for module in modules[1:]:
        head, *rest = module.body
        if module.header:
            head = head.with_changes(leading_lines=[*module.header, *head.leading_lines])
        body.append(head)
        body.extend(rest)
    last = modules[-1]
    return first.with_changes(body=body, footer=last.footer, has_trailing_newline=last.has_trailing_newline)


def _joinable(modules: list[cst.Module]) -> bool:
    """Whether joining ``modules`` gives the whole text's tree (see the module docstring)."""
    first = modules[0]
    for index, module in enumerate(modules):
        if (
            module.default_indent != first.default_indent
            or module.default_newline != first.default_newline
            or module.encoding != first.encoding
        ):
            return False
        if index and not module.body:  # its lines would belong to the previous piece's footer
            return False
        if index < len(modules) - 1 and module.footer:
            return False
    return True
