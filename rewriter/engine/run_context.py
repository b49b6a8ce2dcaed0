"""Run-level context: the source APIs a run's files replace at run time (monkeypatches).

A rewrite that calls flashport directly skips whatever replacement of the source API is installed
when the program runs: a repository whose context-parallel code does
``F.scaled_dot_product_attention = cp_sdpa`` would, once ported, compute attention over the local
shard only. Before any file of a run is transformed, :func:`for_paths` reads every file and records
each such replacement as a :class:`~flashport.rules.base.Patch` in the
:class:`~flashport.rules.base.RuleOptions` the engine hands every rule (``ctx.options.patches``).
A patch concerns the files of its own project only (:func:`project_root`: a run over a monorepo or
several checkouts does not let one project's patch refuse another's sites): the engine keeps, for
each file, the patches of its project (:func:`scoped`), and adds the file's own patches
(:func:`with_file_patches`) when it runs without the pre-pass (one file through the API).

What counts as a patch of ``torch.nn.functional.scaled_dot_product_attention`` (through any alias
of the module: ``F``, ``torch.nn.functional``, ``import torch.nn.functional as nnf``,
``from torch.nn import functional``), and of a flash-attn function (``flash_attn.flash_attn_func``,
``flash_attn_interface.flash_attn_func``, ...):

* an assignment to the attribute (``F.scaled_dot_product_attention = wrapper``, also augmented or
  annotated, also inside a tuple target);
* ``setattr(F, "scaled_dot_product_attention", ...)``, ``monkeypatch.setattr(...)`` (object and
  name, or the dotted string), ``mock.patch("torch.nn.functional.scaled_dot_product_attention")``
  and ``mock.patch.object(F, "scaled_dot_product_attention")``;
* a use of torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``), which
  replaces ``F.scaled_dot_product_attention`` while it is active (its monkey-patch dispatch mode).

What the rules do with it: FPA101 sends SDPA calls made through the module attribute to the
patch-aware drop-in (:mod:`flashport.integrations.sdpa_compat`) with their arguments verbatim, and
keeps calls through a name bound earlier (whether it holds torch's SDPA or the patch depends on
the order the program runs in); flash-attn sites of a patched function are kept with a reason
naming the patch (:func:`refuse_patched`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
from collections.abc import Iterable

from flashport.rewriter.source import semantic
from flashport.rewriter.source.files import read_regular
from flashport.rules.base import Outcome, Patch, Refusal, Rewrite, RuleOptions

SDPA = "torch.nn.functional.scaled_dot_product_attention"
# APIs whose rules port a patched site faithfully themselves (FPA101: the patch-aware drop-in).
PATCH_AWARE = frozenset((SDPA,))
_FUNCTIONAL = "torch.nn.functional"
_CONTEXT_PARALLEL = "torch.distributed.tensor.experimental"
# A file can only patch when a patchable name is an attribute followed by what an assignment target
# or a tuple target has after it, or sits in a string (setattr / mock.patch), or it mentions
# torch's experimental context parallelism: a cheap filter before parsing (calls and imports of the
# names never match it), after a plain substring test that most files already fail.
_NAMES = r"(?:scaled_dot_product_attention|flash_attn_\w+)"
_SHAPE = rf"""\.{_NAMES}\s*(?:[,:]|=(?!=))|{_NAMES}['"]|tensor\.experimental"""
_LITERALS = ("scaled_dot_product_attention", "flash_attn_", "tensor.experimental")
_TRIGGER = re.compile(_SHAPE.encode())
_TEXT_TRIGGER = re.compile(_SHAPE)


# What marks the top folder of a project (the nearest one above a file wins).
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def for_paths(paths: Iterable[str], options: RuleOptions) -> RuleOptions:
    """``options`` with the patches found in the files at ``paths``, each tied to the project of
    its file (:func:`project_root`; unreadable or unparsable files are skipped: the run reports
    them itself)."""
    _root_of.cache_clear()  # a new run: the trees may have changed since the last one
    found: list[Patch] = []
    for path in paths:
        try:
            data = read_regular(path)  # never blocks on a FIFO
        except OSError:
            continue
        patches = find_patches(data, path)
        if patches:
            root = project_root(path)
            found += [dataclasses.replace(patch, root=root) for patch in patches]
    return _merged(options, found)


def project_root(path: str) -> str:
    """The absolute folder of the project ``path`` belongs to: the nearest one at or above the
    file's folder that holds one of :data:`PROJECT_MARKERS` (the file system's root when none does:
    files outside any project form one)."""
    return _root_of(os.path.dirname(os.path.abspath(path)))


@functools.lru_cache(maxsize=4096)
def _root_of(directory: str) -> str:
    if any(os.path.exists(os.path.join(directory, marker)) for marker in PROJECT_MARKERS):
        return directory
    parent = os.path.dirname(directory)
    return directory if parent == directory else _root_of(parent)


def scoped(options: RuleOptions, path: str) -> RuleOptions:
    """``options`` keeping only the patches that concern the file at ``path``: those of its
    project (:func:`project_root`) and those tied to none."""
    if all(patch.root is None for patch in options.patches):
        return options
    root = project_root(path)
    patches = tuple(p for p in options.patches if p.root is None or p.root == root)
    return options if patches == options.patches else dataclasses.replace(options, patches=patches)


def find_patches(data: bytes, path: str) -> list[Patch]:
    """The patches in one file's bytes (none when it does not parse)."""
    if not any(word.encode() in data for word in _LITERALS) or not _TRIGGER.search(data):
        return []
    try:
        tree = ast.parse(data, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    return file_patches(tree, path)


def with_file_patches(options: RuleOptions, tree: ast.Module, path: str, text: str) -> RuleOptions:
    """``options`` plus the patches of the file being transformed (``tree`` parsed from ``text``)."""
    if not any(word in text for word in _LITERALS) or not _TEXT_TRIGGER.search(text):
        return options
    return _merged(options, file_patches(tree, path))


def refuse_patched(outcome: Outcome, api: str, options: RuleOptions) -> Outcome:
    """``outcome``, or a refusal when it rewrites a site of ``api`` that the run patches and whose
    rule cannot forward to the patch (every API but :data:`PATCH_AWARE`)."""
    patch = options.patch_of(api) if isinstance(outcome, Rewrite) and api not in PATCH_AWARE else None
    if patch is None:
        return outcome
    return Refusal(
        f"{api} is replaced at run time at {patch.where()} ({patch.how}); flashport's port would skip "
        "that replacement: kept"
    )


def file_patches(tree: ast.Module, path: str) -> list[Patch]:
    """The patches in one parsed file (module docstring)."""
    model = semantic.of(tree)
    found: list[Patch] = []
    for node in ast.walk(tree):
        api, how = _patched_api(node, model)
        if api is not None:
            found.append(Patch(api, path, getattr(node, "lineno", 0), how))
    return found


def _merged(options: RuleOptions, found: list[Patch]) -> RuleOptions:
    patches = tuple(dict.fromkeys((*options.patches, *found)))
    return options if patches == options.patches else dataclasses.replace(options, patches=patches)


def _patched_api(node: ast.AST, model: semantic.SemanticModel) -> tuple[str | None, str]:
    """``(api, how)`` when ``node`` replaces a source API, else ``(None, "")``."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in (t for top in targets for t in ast.walk(top) if isinstance(t, ast.Attribute)):
            api = _patchable(model.resolve(target))  # `name = None` rebinds a name, patches nothing
            if api is not None:
                return api, _shown(node)
    elif isinstance(node, ast.Call):
        api = _patchable(_patch_call_target(node, model))
        if api is not None:
            return api, _shown(node)
    elif isinstance(node, ast.Attribute) or semantic.is_import(node):
        if _uses_context_parallel(node, model):
            return SDPA, "torch's context_parallel replaces F.scaled_dot_product_attention while active"
    return None, ""


def _patch_call_target(call: ast.Call, model: semantic.SemanticModel) -> str:
    """The dotted name a ``setattr``/``monkeypatch.setattr``/``mock.patch(.object)`` call replaces."""
    callee = semantic.dotted(call.func)
    args = call.args
    last = callee.rsplit(".", 1)[-1]
    if last == "setattr" or callee.endswith("patch.object"):
        if len(args) >= 2 and _string(args[1]) is not None:
            return f"{model.resolve(args[0])}.{_string(args[1])}"
        if last == "setattr" and args and _string(args[0]) is not None:
            return _string(args[0]) or ""
    elif last == "patch" and args and _string(args[0]) is not None:
        return _string(args[0]) or ""
    return ""


def _patchable(dotted: str) -> str | None:
    """``dotted`` when it names SDPA or a flash-attn function, else None."""
    if dotted == SDPA:
        return SDPA
    module, _, name = dotted.rpartition(".")
    if name.startswith("flash_attn_") and module.split(".")[0] in ("flash_attn", "flash_attn_interface"):
        return dotted
    return None


def _uses_context_parallel(node: ast.AST, model: semantic.SemanticModel) -> bool:
    if semantic.is_import(node):
        return any(
            b.node is node
            and b.from_module.startswith(_CONTEXT_PARALLEL)
            and b.alias.name == "context_parallel"
            for b in model.imports
        )
    if isinstance(node, ast.Attribute) and node.attr == "context_parallel":
        return model.resolve(node).startswith(_CONTEXT_PARALLEL)
    return False


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _shown(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 80 else text[:77] + "..."
