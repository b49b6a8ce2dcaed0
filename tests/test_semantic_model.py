"""The per-file semantic model (``rewriter/source/semantic.py``): its answers checked against libcst's
own scope analysis (an independent implementation) and small hand-read files, and the structure rule
that only the model and the import edits read import statements."""

from __future__ import annotations

import ast
import pathlib
import textwrap

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from flashport.rewriter.source import semantic

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The only product code that may read import statements itself: the model and the import edits.
IMPORT_READERS = {
    ROOT / "rewriter" / "source" / "semantic.py",
    *sorted((ROOT / "rewriter" / "imports").glob("*.py")),
}
IMPORT_NODES = {"Import", "ImportFrom"}


def import_node_reads(source: str) -> list[int]:
    """Lines of ``source`` that name ``ast.Import``/``ast.ImportFrom`` (as ``ast.X`` or imported from ``ast``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in IMPORT_NODES
            and isinstance(node.value, ast.Name)
            and node.value.id == "ast"
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "ast":
            lines.extend(node.lineno for a in node.names if a.name in IMPORT_NODES)
    return lines


def test_the_structure_check_sees_an_import_read():
    assert import_node_reads("isinstance(n, (ast.Import, ast.ImportFrom))") == [1, 1]
    assert import_node_reads("from ast import ImportFrom") == [1]
    assert import_node_reads("isinstance(n, cst.Import)") == []


def test_only_the_model_and_the_import_edits_read_import_statements():
    product = [
        p for package in ("flashport", "rewriter", "rules", "kernels") for p in (ROOT / package).rglob("*.py")
    ]
    assert len(product) > 150
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in product
        if path not in IMPORT_READERS and (lines := import_node_reads(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}, "ask rewriter.source.semantic (SemanticModel.imports, is_import, import_names)"


SAMPLE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    import flash_attn.flash_attn_interface
    from flash_attn import flash_attn_func as fa, flash_attn_varlen_func
    from torch.nn.attention import sdpa_kernel, SDPBackend
    try:
        from xformers.ops import memory_efficient_attention as mea
    except ImportError:
        mea = None

    def f(q, k, v):
        from torch.nn.attention import SDPBackend as B
        F.scaled_dot_product_attention(q, k, v)
        fa(q, k, v)
        flash_attn.flash_attn_interface.flash_attn_func(q, k, v)
        torch.nn.functional.softmax(q)
        flash_attn_varlen_func(q, k, v)
        sdpa_kernel(B.MATH)
        return SDPBackend.FLASH_ATTENTION
    """
)


def _libcst_names(source: str) -> dict[tuple[int, str], set[str]]:
    """libcst's qualified names of every Name/Attribute chain, by (line, dotted text)."""
    out: dict[tuple[int, str], set[str]] = {}

    class Collect(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, (cst.Name, cst.Attribute)):
                text = cst.helpers.get_full_name_for_node(node)
                line = self.get_metadata(PositionProvider, node).start.line
                out[(line, text)] = {n.name for n in self.get_metadata(QualifiedNameProvider, node, set())}
            return True

    MetadataWrapper(cst.parse_module(source)).visit(Collect())
    return out


def test_import_resolution_agrees_with_libcst():
    tree = ast.parse(SAMPLE)
    model = semantic.of(tree)
    reference = _libcst_names(SAMPLE)
    function = tree.body[-1]
    chains = [
        n
        for n in ast.walk(function)
        if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load)
    ]
    imported = {"torch", "F", "flash_attn", "fa", "flash_attn_varlen_func", "sdpa_kernel", "SDPBackend", "B"}
    checked = 0
    for node in chains:
        text = semantic.dotted(node)
        if text.split(".")[0] not in imported:
            continue  # parameters: libcst names them `f.<locals>.q`; the model resolves imports only
        expected = reference[(node.lineno, text)]
        assert model.qualified_names(node) == expected, text
        assert {model.resolve(node)} == expected, text
        checked += 1
    assert checked >= 12


def test_imports_carry_their_scope_and_qualified_name():
    model = semantic.of(ast.parse(SAMPLE))
    table = {(b.name, b.qualified, bool(b.scopes), b.module_scope) for b in model.imports}
    assert ("F", "torch.nn.functional", False, True) in table
    assert ("flash_attn", "flash_attn", False, True) in table
    assert ("fa", "flash_attn.flash_attn_func", False, True) in table
    assert ("mea", "xformers.ops.memory_efficient_attention", False, True) in table  # in a try: module scope
    assert ("B", "torch.nn.attention.SDPBackend", True, False) in table


def test_imports_at_a_line_leave_out_what_cannot_be_told():
    source = textwrap.dedent(
        """
        from torch.nn.attention import sdpa_kernel
        from a import x
        from b import x
        from torch import y
        y = 1
        from .rel import z

        def g():
            from torch.nn.attention import SDPBackend
            return SDPBackend

        def h():
            return 0
        """
    )
    model = semantic.of(ast.parse(source))
    assert model.imports_at(11) == {
        "sdpa_kernel": "torch.nn.attention.sdpa_kernel",
        "SDPBackend": "torch.nn.attention.SDPBackend",
    }
    assert model.imports_at(14) == {"sdpa_kernel": "torch.nn.attention.sdpa_kernel"}
    assert model.qualified_name_at("SDPBackend.MATH", 11) == "torch.nn.attention.SDPBackend.MATH"
    assert model.qualified_name_at("SDPBackend.MATH", 14) == ""


def test_an_import_in_an_enclosing_function_reaches_its_closures_unless_a_parameter_shadows_it():
    source = textwrap.dedent(
        """
        def factory():
            import torch.nn.functional as G

            class Processor:
                def __call__(self, q):
                    return G.scaled_dot_product_attention(q, q, q)

            def shadowed(G):
                return G.scaled_dot_product_attention(1)

            return Processor
        """
    )
    model = semantic.of(ast.parse(source))
    assert model.qualified_name_at("G.scaled_dot_product_attention", 7) == (
        "torch.nn.functional.scaled_dot_product_attention"
    )
    assert model.qualified_name_at("G.scaled_dot_product_attention", 10) == ""


def test_local_value_is_a_variable_an_enclosing_function_binds_once():
    source = textwrap.dedent(
        """
        def f():
            chosen = [1, 2]
            twice = [1]
            twice = [2]

            def inner(param):
                return chosen, twice, param

            return inner

        def g():
            chosen = [3]
            return chosen
        """
    )
    model = semantic.of(ast.parse(source))
    value, function = model.local_value("chosen", 8)  # in inner: f's variable
    assert isinstance(value, ast.List) and value.elts[0].value == 1 and function.name == "f"
    assert model.local_value("chosen", 14)[0].elts[0].value == 3  # g's own variable
    assert model.local_value("twice", 8) is None
    assert model.local_value("param", 8) is None  # a parameter, no `=`
    assert model.local_value("missing", 8) is None


def test_an_if_else_binding_in_both_branches_hides_what_came_before():
    source = textwrap.dedent(
        """
        def f(npu):
            from a import pad
            if npu:
                from b import pad
            else:
                from c import pad
            return pad

        def g(npu):
            from a import pad
            if npu:
                from b import pad
            return pad
        """
    )
    model = semantic.of(ast.parse(source))
    assert sorted(b.qualified for b in model.reaching("pad", 8)) == ["b.pad", "c.pad"]
    assert sorted(b.qualified for b in model.reaching("pad", 14)) == ["a.pad", "b.pad"]


def test_a_star_import_hides_what_came_before():
    model = semantic.of(
        ast.parse("from torch.nn.attention import SDPBackend\nfrom m import *\nSDPBackend.MATH\n")
    )
    assert "SDPBackend" not in model.imports_at(3)
    assert model.star_import_lines() == [2]


def test_module_constants_aliases_and_exports():
    source = textwrap.dedent(
        """
        from flash_attn import flash_attn_func
        BACKENDS = [1, 2]
        if True:
            GUARDED = (3,)
        TWICE = 1
        TWICE = 2
        REBOUND = 1

        def f(REBOUND):
            return REBOUND

        attn = flash_attn_func
        other = get().flash_attn_func

        class M:
            def __init__(self):
                self.fn = flash_attn_func

        __all__ = ["attn", "M"]
        """
    )
    tree = ast.parse(source)
    model = semantic.of(tree)
    assert isinstance(model.module_constant("BACKENDS"), ast.List)
    assert isinstance(model.module_constant("GUARDED"), ast.Tuple)
    assert model.module_constant("TWICE") is None
    assert model.module_constant("REBOUND") is None  # a parameter binds it too
    assert model.module_constant("missing") is None
    assert model.value_aliases(tree.body) == [("attn", "flash_attn_func"), ("other", ".flash_attn_func")]
    assert {(a.names, a.attributes, a.value) for a in model.assignments()} == {
        (("attn",), (), "flash_attn_func"),
        (("other",), (), ".flash_attn_func"),
        ((), ("fn",), "flash_attn_func"),
    }
    assert model.exports == ("attn", "M")
    assert [b.kind for b in model.binding("TWICE")] == ["assign", "assign"]
    (imported,) = model.binding("flash_attn_func")
    assert isinstance(imported, semantic.ImportBinding) and imported.qualified == "flash_attn.flash_attn_func"
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert model.binding("fn", method) == []  # an attribute is no binding of the scope


def test_parent_and_enclosing():
    tree = ast.parse("class C:\n    def m(self):\n        return f(x)\n")
    model = semantic.of(tree)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    assert isinstance(model.parent(call), ast.Return)
    assert model.enclosing(call).name == "m"
    assert model.enclosing(call, ast.ClassDef).name == "C"
    assert model.parent(tree) is None
    assert model.function_at(3).name == "m"
    assert model.function_at(1) is None


def test_comparisons_and_mentions():
    source = textwrap.dedent(
        """
        from xformers.ops import memory_efficient_attention as mea
        import xformers.ops as xops
        \"\"\"memory_efficient_attention in a docstring is no mention\"\"\"
        if flag:
            ok = type(m) is RotaryEmbedding
        y = mea(q, k, v) + xops.memory_efficient_attention(q, k, v)
        fn = getattr(xops, "memory_efficient_attention_forward")
        if RotaryEmbedding == other:
            pass
        """
    )
    model = semantic.of(ast.parse(source))
    assert model.first_comparison({"RotaryEmbedding"}) == 9  # ast.walk order: the shallower one
    assert model.first_comparison({"m"}) is None  # `type(m)` is a call, no plain read as a side
    assert model.first_comparison({"other_name"}) is None
    assert model.first_comparison(set()) is None
    uses = model.mentions(lambda text: text.startswith("memory_efficient_attention") or text == "mea")
    assert dict(uses) == {7: 2, 8: 1}  # the import line and the docstring are no mentions


def test_the_model_is_built_once_per_tree():
    tree = ast.parse("import torch\n")
    assert semantic.of(tree) is semantic.of(tree)
    assert semantic.of(ast.parse("import torch\n")) is not semantic.of(tree)


@pytest.mark.parametrize(
    ("statement", "names"),
    [
        ("import a.b.c", ["a"]),
        ("import a.b as c", ["c"]),
        ("from m import x, y as z", ["x", "z"]),
        ("x = 1", []),
    ],
)
def test_import_names(statement, names):
    node = ast.parse(statement).body[0]
    assert semantic.import_names(node) == names
    assert semantic.is_import(node) == bool(names)


FLOW = textwrap.dedent(
    """\
    import torch
    if cuda:
        from flash_attn import flash_attn_func
        probe(flash_attn_func)  # 4: the import above
    if npu:
        from npu import npu_func as flash_attn_func
        probe(flash_attn_func)  # 7: the NPU import
    probe(flash_attn_func)  # 8: either (no binding dominates)
    def f():
        probe(flash_attn_func)  # 10: a global: any caller may run first
    def g(x, flash_attn_func):
        probe(flash_attn_func)  # 12: the parameter
        from flash_attn import flash_attn_func
        flash_attn_func = wrap(flash_attn_func)  # 14: the read runs before the binding
        probe(flash_attn_func)  # 15: the wrapper
        for i in x:
            probe(flash_attn_func)  # 17: the wrapper, or line 19's value on a later turn
            if i: probe(flash_attn_func)  # 18: a one-line block
            flash_attn_func = 3
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            probe(flash_attn_func)  # 23: the try may have run
        probe(lambda: flash_attn_func)  # 24: deferred
    with a as flash_attn_func:
        probe(flash_attn_func)  # 26: the with target, or before
    class C:
        probe(flash_attn_func)  # 28: a class body
    from flash_attn import flash_attn_func; probe(flash_attn_func)  # 29: two statements
    from flash_attn import flash_attn_func
    probe(flash_attn_func)  # 31: the import above
    """
)


def reaching_lines(source: str, name: str, line: int) -> list[int] | None:
    """The lines of the bindings ``reaching`` answers for a read at ``line`` (None: undecided)."""
    found = semantic.of(ast.parse(source)).reaching(name, line)
    if found is None:
        return None
    return sorted(b.node.lineno if isinstance(b, semantic.ImportBinding) else b.lineno for b in found)


@pytest.mark.parametrize(
    ("line", "lines"),
    [
        (4, [3]),
        (7, [6]),
        (8, None),
        (10, None),
        (12, [11]),
        (14, None),
        (15, [14]),
        (17, [14, 19]),
        (18, None),
        (23, [14, 19, 21]),
        (24, None),
        (26, None),
        (28, None),
        (29, None),
        (31, [30]),
    ],
)
def test_reaching_bindings_follow_the_flow(line, lines):
    assert reaching_lines(FLOW, "flash_attn_func", line) == lines


def test_reaching_is_undecided_where_the_name_is_declared_global_or_star_imported():
    declared = "from flash_attn import f\ndef init():\n    global f\n    f = None\nprobe(f)\n"
    assert reaching_lines(declared, "f", 5) is None
    starred = "from flash_attn import f\nfrom m import *\nprobe(f)\n"
    assert reaching_lines(starred, "f", 3) is None
    rebound = "from npu import f\nfrom flash_attn import f\nprobe(f)\n"
    assert reaching_lines(rebound, "f", 3) == [2]
    single = "from flash_attn import f\nprobe(f)\n"  # one binding: nothing to hide, left to libcst
    assert reaching_lines(single, "f", 2) is None


def test_reaching_is_undecided_where_a_header_shares_the_line_of_its_body():
    one_line = "from flash_attn import f\nwith ctx(f) as g: probe(f)\nif f: probe(f)\n"
    assert reaching_lines(one_line, "f", 2) is None
    assert reaching_lines(one_line, "f", 3) is None
    header = "from npu import f\nfrom flash_attn import f\nif probe(f):\n    pass\n"
    assert reaching_lines(header, "f", 3) == [2]


def test_reaching_a_decorator_sees_the_bindings_before_its_definition():
    source = textwrap.dedent(
        """\
        from flash_attn import f
        if npu:
            from npu import g as f
            @register(f)
            def h():
                pass
        """
    )
    assert reaching_lines(source, "f", 4) == [3]
