"""Port real model code: how much of it the codemod ports, why it refuses the rest, and whether the
ported files still need the GPU libraries.

Run:  .venv/bin/python benchmarks/real_repos.py [--packages sglang,deepspeed] [--speed-sites 20000] [--no-import-check]

Each pinned package (sources or wheels, no dependencies) is fetched once with ``pip download`` into a
cache outside the repository (``$FLASHPORT_BENCH_CACHE/real_repos`` or
``~/.cache/flashport-bench/real_repos``; :func:`benchmarks.corpus.fetch`) and every ``.py`` file is run
through :func:`flashport.rewriter.engine.pipeline.transform_source` with the default rules and options.
Files under ``tests/``, ``benchmarks/``, ``examples/`` (and ``test_*.py``) are *test* code, the rest
*model* code. Per package it prints:

* model-code call and value-use sites (config strings aside), how many were ported, how many run
  *as is* (kept byte-identical because they need no change on a TPU host: SDPA backend switches and
  probes of torch SDPA's kernels, reported with the reason prefix ``RUNS_AS_IS``), and test sites;
  the share counts ported + as is, and the line under the table gives the ported share alone;
* refusals by reason (model code);
* checks on every changed file: it compiles, a second run changes nothing, every changed line is in
  a rewritten site, an import, a guard/alias the import clean-up removed or a ``__version__`` read it
  pinned ("stray" otherwise);
* dead GPU imports: a name bound from a GPU module that the original file read and the ported file
  no longer reads (the port should have removed the import); listed apart, not counted, when the
  codemod kept it as part of an availability probe (a ``try`` whose other GPU import or flag is still
  read: removing it could flip the flag where only this import would fail);
* *fully ported* files (every site rewritten or run as is) that still import a GPU module (``flash_attn``,
  ``xformers``, ...) statically, with the codemod's reason for keeping each import
  (``FileResult.imports_kept``), in two columns: *needs GPU import* (an import a TPU host would trip
  on) and *GPU probes kept* (every GPU import left is inside a ``try`` and only asks whether or which
  library is installed - an availability probe, a ``__version__``/``__file__`` read - so the file
  takes its fallback where the library is absent); and - unless ``--no-import-check`` - whether their module imports
  in a subprocess where GPU modules are blocked (``ok``, ``gpu`` = a GPU import was attempted,
  ``dep`` = another dependency of the package is missing here, so nothing is known);
* crashes (internal engine errors).

Then the per-site speed on a generated file of ``--speed-sites`` ``flash_attn_func`` calls
(goal: <= 1 ms a site, 20,000 sites in < 20 s), as wall and CPU seconds.

Exit status 0 when there are no crashes, no stray changes, and every changed file compiles and is
idempotent; the porting share is reported, not enforced.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus

from flashport import rules as registry
from flashport.rewriter.engine import run_context
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rewriter.imports.edits import name_uses
from flashport.rules.base import RUNS_AS_IS, RuleOptions

# name, version: sources or wheels that carry model code calling flash-attn / xformers / SDPA
PACKAGES = (
    ("sglang", "0.5.23"),
    ("megatron-core", "0.16.1"),
    ("deepspeed", "0.19.8"),
    ("torchtune", "0.6.1"),
    ("torchtitan", "0.3.0"),
    ("unsloth", "2026.10.9"),
    ("axolotl", "0.19.0"),
    ("colossalai", "0.5.0"),
    ("fairseq2", "0.8.1"),
    ("lmdeploy", "0.18.0"),
)
# what a TPU/CPU host lacks (jax itself stays: flashport runs on it; its GPU-only submodules load lazily)
# owner/name, commit: public repositories fetched from git (sources at that commit), a set the rules
# were not written against: video diffusion, context parallelism, training frameworks, RL, inference,
# JAX model zoos. Selected with --set fresh.
FRESH = (
    ("Tencent/HunyuanVideo", "fa14b001c18f37191c938a9ef6baad3b9b472759"),
    ("Wan-Video/Wan2.1", "9737cba9c1c3c4d04b33fcad41c111989865d315"),
    ("hpcaitech/Open-Sora", "7ad6a96a135feb81f755c84fb391818718f6beb2"),
    ("xdit-project/xDiT", "175e0bfec974d0b44a0be9fa511df2f9f5ead080"),
    ("feifeibear/long-context-attention", "56118e0d8fe377d43441226dd8bdd07135c92c22"),
    ("zhuzilin/ring-flash-attention", "899628238f2f5bb8c028579c89b7cd56ea451d2a"),
    ("OpenRLHF/OpenRLHF", "3c3be6234e0cb353e76bb8019947db9dfe99fca7"),
    ("volcengine/verl", "b178a3cd56f58b2d502255daba591e92833930a7"),
    ("huggingface/nanotron", "2411b022a75fb7f7561a1bb4166706da5e1b76de"),
    ("Lightning-AI/litgpt", "26857050fe3ff627cd714fe92f5838f51a3d5efa"),
    ("mistralai/mistral-inference", "2557e12d0e1878a1562ece30434820f80aa3e12a"),
    ("stanford-crfm/levanter", "9263f81e8b453241332c2c0b2d2001bfb2d2241c"),
    ("apple/axlearn", "34aed43c1b6e581c4753d06d7cbeedd5010ef26b"),
    ("AI-Hypercomputer/maxtext", "e591f30cbbf217ed67ef71263ec0538239f9c3b8"),
    ("young-geng/EasyLM", "fe5b2c354e25d697fce7cd225e23bbbe72570da3"),
    ("google-research/big_vision", "0127fb6b337ee2a27bf4e54dea79cff176527356"),
    # added later, measured once before and once after the rule changes of the same session
    ("jzhang38/EasyContext", "6b0d31047e4e326cbd603f89d57cf8b1db3ff762"),  # context parallelism
    ("genmoai/mochi", "0c86aebf386e6622deadfb47ff1996878cefc0ac"),  # video diffusion
    ("huggingface/text-generation-inference", "db931fcf42da018a3657580c64bf2720f167f9ab"),  # inference server
    ("AI-Hypercomputer/maxdiffusion", "7cfb8801d41d1728f0232cd7ee59e900a151fecf"),  # JAX diffusion
)
BLOCKED = ("flash_attn", "flash_attn_interface", "flash_attn_3", "hopper", "xformers", "flash_attn_jax")
TEST_PARTS = {"tests", "test", "testing", "benchmarks", "benchmark", "examples", "example"}


@dataclasses.dataclass
class Result:
    """What happened to one package."""

    name: str
    version: str
    files: int = 0
    model_sites: int = 0
    model_ported: int = 0
    model_as_is: int = 0  # kept byte-identical: needs no change on a TPU host (RUNS_AS_IS)
    test_sites: int = 0
    test_ported: int = 0
    refusals: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    changed: int = 0
    not_compiling: list = dataclasses.field(default_factory=list)
    not_idempotent: list = dataclasses.field(default_factory=list)
    stray: list = dataclasses.field(default_factory=list)
    crashes: list = dataclasses.field(default_factory=list)
    syntax_errors: int = 0
    fully_ported: list = dataclasses.field(default_factory=list)  # (root, relative path, new bytes)
    still_gpu: list = dataclasses.field(default_factory=list)  # a GPU import a TPU host would trip on
    probes_kept: list = dataclasses.field(default_factory=list)  # only guarded probes of the real library
    dead_gpu: list = dataclasses.field(default_factory=list)  # GPU imports the port left unread
    dead_probes: list = dataclasses.field(default_factory=list)  # ... kept: their try is a probe still read
    imports: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    gpu_on_import: list = dataclasses.field(default_factory=list)
    patches: list = dataclasses.field(default_factory=list)  # run-time patches of source APIs (run_context)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every guarantee held."""
        return not (self.crashes or self.stray or self.not_compiling or self.not_idempotent)


def is_test(relative: str) -> bool:
    """Test, benchmark or example code (by path)."""
    parts = relative.replace(os.sep, "/").split("/")
    return bool(TEST_PARTS & {p.lower() for p in parts[:-1]}) or parts[-1].startswith("test_")


def normalize(reason: str) -> str:
    """A refusal reason with its call-specific code removed, for grouping."""
    reason = re.sub(r"\b[\w.]+=\S+", "<arg>=<expr>", reason)
    reason = re.sub(r"line \d+", "line N", reason)
    reason = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", reason)
    return reason[:110]


GUARDED = " (guarded)"
# rewriter/imports/kept_imports.py's reasons for a guarded import that only asks about the installed library
PROBE_REASONS = (
    "an availability probe:",
    "it inspects the installed library",
    "the probe asks about the real library",
)


def probe_lines(imports_kept: list[str]) -> set[int]:
    """Lines of the GPU imports the codemod kept as probes (``FileResult.imports_kept`` reasons)."""
    found = set()
    for line in imports_kept:
        where = re.search(r"\(line (\d+)\)", line)
        if where and any(p in line for p in PROBE_REASONS):
            found.add(int(where.group(1)))
    return found


def gpu_imports(data: bytes, gpu_modules: tuple[str, ...]) -> list[str]:
    """GPU modules a file still imports, at any scope (``guarded`` when inside try/if)."""
    found = []
    tree = ast.parse(data)
    guarded_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Try, ast.If)):
            guarded_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if any(name == m or name.startswith(m + ".") for m in gpu_modules):
                found.append(f"{name}{GUARDED if node.lineno in guarded_lines else ''}")
    return found


def dead_gpu_imports(old: bytes, new: bytes, gpu_modules: tuple[str, ...]) -> list[str]:
    """GPU imports the port left dead: names bound from a GPU module that the original file read and the
    ported file no longer reads (``from m import *`` cannot be judged and is skipped)."""
    read_before, tree = name_uses(ast.parse(old)), ast.parse(new)
    read_after = name_uses(tree)
    dead = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            module, bound = node.module or "", [a.asname or a.name for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            module, bound = "", []
            for alias in node.names:
                if any(alias.name == m or alias.name.startswith(m + ".") for m in gpu_modules):
                    module = alias.name
                    bound.append(alias.asname or alias.name.split(".")[0])
        else:
            continue
        if not any(module == m or module.startswith(m + ".") for m in gpu_modules):
            continue
        dead.extend(
            f"{module}: {name} (line {node.lineno})"
            for name in bound
            if name in read_before and name not in read_after
        )
    return dead


def _allowed_lines(old: bytes, sites, gpu_modules) -> set[int]:
    """Old lines a port may change: rewritten sites, imports, and guards/aliases around GPU imports."""
    allowed = {line for s in sites if s.status == "rewrite" for line in range(s.line, s.end_line + 1)}
    alias_lines = {s.line for s in sites if s.kind == "reference" and s.status == "rewrite"}
    tree = ast.parse(old)
    for node in ast.walk(tree):
        span = (
            range(node.lineno, (getattr(node, "end_lineno", None) or node.lineno) + 1)
            if hasattr(node, "lineno")
            else ()
        )
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            allowed.update(span)
        elif isinstance(node, (ast.Try, ast.If)) and gpu_imports(ast.unparse(node).encode(), gpu_modules):
            allowed.update(span)
        elif isinstance(node, ast.Assign) and node.lineno in alias_lines:
            allowed.update(span)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "__version__"
            and isinstance(node.value, ast.Name)
        ):
            allowed.update(span)  # a flash-attn version read the import clean-up pins
    return allowed


def check_changes(path: str, old: bytes, new: bytes, sites, gpu_modules) -> list[str]:
    """Changed old lines outside what a port may change (empty when every change is explained)."""
    allowed = _allowed_lines(old, sites, gpu_modules)
    old_lines = old.decode("utf-8", "replace").splitlines()
    new_lines = new.decode("utf-8", "replace").splitlines()
    stray = []
    opcodes = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes()
    # an old line the diff removed and added back elsewhere (aligned around a rewrite), not changed
    added = collections.Counter(
        line for tag, _, _, j1, j2 in opcodes if tag != "equal" for line in new_lines[j1:j2]
    )
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            continue
        for i in range(i1, i2):
            if i + 1 in allowed or not old_lines[i].strip():
                continue
            if added[old_lines[i]]:
                added[old_lines[i]] -= 1
            else:
                stray.append(f"{path}:{i + 1}")
        extra = (
            new_lines[j1 + (i2 - i1) : j2]
            if tag == "replace"
            else new_lines[j1:j2]
            if tag == "insert"
            else []
        )
        inside = any(
            line in allowed for line in (i1, i1 + 1, i2)
        )  # more lines for a rewritten call or import
        stray += [
            f"{path}:+{t.strip()}"
            for t in extra
            if t.strip() and not inside and not t.strip().startswith(("import ", "from ", "pass", "#"))
        ]
    return stray


def _python_files_from_mirror(mirror: str, commit: str, into: str) -> None:
    """Write the ``.py`` files of ``commit`` in the bare git folder ``mirror`` under ``into`` (a mirror
    may lack large non-Python blobs, so the whole tree is not asked for)."""
    listing = subprocess.run(
        ["git", "-C", mirror, "ls-tree", "-r", "-z", commit], capture_output=True, check=True
    ).stdout.split(b"\0")
    blobs = [
        (fields[2], path.decode())
        for fields, path in (
            (entry.split(b"\t", 1)[0].split(), entry.split(b"\t", 1)[1]) for entry in listing if entry
        )
        if fields[1] == b"blob" and path.endswith(b".py")
    ]
    for sha, path in blobs:
        data = subprocess.run(["git", "-C", mirror, "cat-file", "blob", sha], capture_output=True, check=True)
        target = os.path.join(into, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(data.stdout)


def fetch_git(repo: str, commit: str, cache: str) -> str:
    """Check out (once) the ``.py`` files of ``repo`` (owner/name) at ``commit`` into the cache; return
    the folder.

    The objects come from a local mirror when ``$FLASHPORT_GIT_MIRRORS`` holds ``owner+name/repo``
    (a bare git folder), else from github.com.

    Raises:
      RuntimeError: when git cannot fetch it.
    """
    folder = os.path.join(cache, f"{repo.replace('/', '+')}-{commit[:12]}")
    if os.path.isfile(os.path.join(folder, ".complete")):
        return folder
    mirrors = os.environ.get("FLASHPORT_GIT_MIRRORS", "")
    mirror = os.path.join(mirrors, repo.replace("/", "+"), "repo") if mirrors else ""
    with tempfile.TemporaryDirectory(prefix="flashport-git-") as tmp:
        try:
            if mirror and os.path.isdir(mirror):
                _python_files_from_mirror(mirror, commit, tmp)
            else:
                url = f"https://github.com/{repo}.git"
                for step in (["init", "-q"], ["fetch", "-q", "--depth", "1", url, commit]):
                    subprocess.run(["git", "-C", tmp, *step], capture_output=True, check=True)
                _python_files_from_mirror(os.path.join(tmp, ".git"), "FETCH_HEAD", tmp)
                shutil.rmtree(os.path.join(tmp, ".git"))
        except subprocess.CalledProcessError as err:
            raise RuntimeError(f"git {err.cmd[3:]}: {err.stderr.decode(errors='replace')[-300:]}") from err
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tmp, folder)
    open(os.path.join(folder, ".complete"), "w").close()
    return folder


def run_package(name: str, version: str, cache: str) -> Result:
    """Fetch one package (a pinned PyPI release, or owner/name at a git commit) and port every file in
    memory."""
    out = Result(name, version[:12] if "/" in name else version)
    root = fetch_git(name, version, cache) if "/" in name else corpus.fetch(name, version, cache)
    rules = registry.all_rules()
    gpu_modules = tuple(sorted({m for r in rules for m in r.GPU_MODULES}))
    start = time.perf_counter()
    paths = [
        os.path.join(directory, filename)
        for directory, dirs, files in sorted(os.walk(root))
        for filename in sorted(files)
        if filename.endswith(".py")
    ]
    options = run_context.for_paths(paths, RuleOptions())  # the CLI's run-level context, per package
    options = dataclasses.replace(
        options,
        patches=tuple(dataclasses.replace(p, path=os.path.relpath(p.path, root)) for p in options.patches),
    )
    out.patches = [f"{p.where()}: {p.how}" for p in options.patches]
    for path in paths:
        relative = os.path.relpath(path, root)
        data = open(path, "rb").read()
        out.files += 1
        result = transform_source(data, relative, rules, options)
        if result.status == "error":
            if "internal error" in (result.error or ""):
                out.crashes.append(f"{relative}: {result.error}")
            else:
                out.syntax_errors += 1
            continue
        counted = [s for s in result.sites if s.kind in ("call", "reference")]
        ported = [s for s in counted if s.status == "rewrite"]
        as_is = [s for s in counted if s.status != "rewrite" and s.reason.startswith(RUNS_AS_IS)]
        if is_test(relative):
            out.test_sites += len(counted)
            out.test_ported += len(ported)
        else:
            out.model_sites += len(counted)
            out.model_ported += len(ported)
            out.model_as_is += len(as_is)
            out.refusals.update(
                f"{s.rule} {s.kind}: {normalize(s.reason)}"
                for s in counted
                if s.status != "rewrite" and s not in as_is
            )
        if result.new is None:
            continue
        out.changed += 1
        try:
            compile(result.new, relative, "exec", dont_inherit=True)
        except SyntaxError as err:
            out.not_compiling.append(f"{relative}: {err}")
            continue
        if transform_source(result.new, relative, rules, options).new is not None:
            out.not_idempotent.append(relative)
        out.stray += check_changes(relative, data, result.new, result.sites, gpu_modules)
        probes = probe_lines(result.imports_kept)
        for dead in dead_gpu_imports(data, result.new, gpu_modules):
            line = re.search(r"\(line (\d+)\)", dead)
            kept = out.dead_probes if line and int(line.group(1)) in probes else out.dead_gpu
            kept.append(f"{relative}: {dead}")
        if counted and len(ported) + len(as_is) == len(counted) and not is_test(relative):
            out.fully_ported.append((root, relative, result.new))
            left = gpu_imports(result.new, gpu_modules)
            if left:
                why = "".join(f"\n      kept {line}" for line in result.imports_kept)
                probes_only = all(m.endswith(GUARDED) for m in left) and all(
                    any(p in line for p in PROBE_REASONS) for line in result.imports_kept
                )
                kept = out.probes_kept if probes_only and result.imports_kept else out.still_gpu
                kept.append(f"{relative}: {', '.join(sorted(set(left)))}{why}")
    out.seconds = time.perf_counter() - start
    return out


_IMPORT_CHECK = r"""
import importlib, importlib.abc, json, sys, traceback
GPU = set(sys.argv[2].split(","))  # top-level module names
def probing():
    # importlib.util.find_spec up the stack: an availability probe (is_flash_attn_3_available()...)
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "find_spec" and "importlib" in code.co_filename and "util" in code.co_filename:
            return True
        frame = frame.f_back
    return False
class Blocker(importlib.abc.MetaPathFinder):
    # A probe gets "not installed" (None: the GPU libraries are absent where this runs, as on a TPU
    # host); an import gets an error that names the module.
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in GPU and not probing():
            raise ImportError(f"GPU module {name} is blocked")
        return None
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])
out = {}
for module in sys.argv[3:]:
    try:
        importlib.import_module(module)
        out[module] = "ok"
    except BaseException as err:  # noqa: BLE001
        text = "".join(traceback.format_exception_only(type(err), err))
        if "is blocked" not in text:
            out[module] = "dep"
            continue
        # where the GPU import was attempted: the innermost frame outside importlib
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename and f.filename != "<string>"]
        where = frames[-1] if frames else None
        place = f"{where.filename.replace(sys.argv[1] + '/', '')}:{where.lineno}" if where else "?"
        out[module] = f"gpu {place}"
print(json.dumps(out))
"""


def import_check(result: Result, gpu_modules: tuple[str, ...]) -> None:
    """Import every fully ported model module (ported text in a copy of the package) with GPU
    modules blocked; counts ok / gpu / dep into ``result.imports``."""
    if not result.fully_ported:
        return
    root = result.fully_ported[0][0]
    with tempfile.TemporaryDirectory(prefix=f"flashport-real-{result.name.replace('/', '+')}-") as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["cp", "-r", root, tree], check=True)
        modules = []
        for _, relative, new in result.fully_ported:
            with open(os.path.join(tree, relative), "wb") as handle:
                handle.write(new)
            parts = relative[:-3].replace(os.sep, "/").split("/")
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        top = {m.split(".")[0] for m in modules}
        base = (
            tree
            if all(
                os.path.isdir(os.path.join(tree, t)) or os.path.isfile(os.path.join(tree, t + ".py"))
                for t in top
            )
            else None
        )
        if base is None:  # an sdist: the package sits one folder down
            inner = [d for d in os.listdir(tree) if os.path.isdir(os.path.join(tree, d))]
            base = os.path.join(tree, inner[0]) if len(inner) == 1 else tree
            modules = [m.split(".", 1)[1] if "." in m else m for m in modules]
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT_CHECK, base, ",".join(BLOCKED), *modules],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        try:
            outcomes = json.loads(done.stdout.strip().splitlines()[-1])
            result.imports.update(how.split()[0] for how in outcomes.values())
            result.gpu_on_import += [
                f"{m} (at {how.split(' ', 1)[1]})" for m, how in outcomes.items() if how.startswith("gpu ")
            ]
        except (json.JSONDecodeError, IndexError):
            result.imports["crash"] += len(modules)


def speed(sites: int) -> tuple[float, float, int]:
    """(wall s, CPU s, bytes) to port a generated file of ``sites`` flash_attn_func calls (20 a function)."""
    lines = ["from flash_attn import flash_attn_func\n\n"]
    for f in range(max(1, sites // 20)):
        lines.append(f"\ndef f{f}(q, k, v):\n")
        lines += [
            f"    o{i} = flash_attn_func(q, k, v, causal=True, softmax_scale=0.{i % 9 + 1})\n"
            for i in range(min(20, sites))
        ]
        lines.append("    return q\n")
    data = "".join(lines).encode()
    rules = registry.all_rules()
    wall, cpu = time.perf_counter(), time.process_time()
    result = transform_source(data, "generated.py", rules, RuleOptions())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert result.status == "changed" and len(result.sites) == max(1, sites // 20) * min(20, sites), (
        result.error
    )
    return wall, cpu, len(data)


def report(results: list[Result]) -> None:
    """Print the per-package table and the top refusal reasons."""
    head = (
        "package",
        "files",
        "model sites",
        "ported",
        "as is",
        "share",
        "test sites",
        "test ported",
        "changed",
        "compile/idem",
        "stray",
        "dead GPU import",
        "crashes",
        "fully ported",
        "needs GPU import",
        "GPU probes kept",
        "import ok/gpu/dep",
        "s",
    )
    rows = []
    for r in results:
        share = f"{100 * (r.model_ported + r.model_as_is) / r.model_sites:.0f}%" if r.model_sites else "-"
        rows.append(
            (
                f"{r.name}@{r.version}" if "/" in r.name else f"{r.name}=={r.version}",
                r.files,
                r.model_sites,
                r.model_ported,
                r.model_as_is,
                share,
                r.test_sites,
                r.test_ported,
                r.changed,
                "ok"
                if not (r.not_compiling or r.not_idempotent)
                else f"{len(r.not_compiling)}/{len(r.not_idempotent)}",
                len(r.stray),
                len(r.dead_gpu),
                len(r.crashes),
                len(r.fully_ported),
                len(r.still_gpu),
                len(r.probes_kept),
                f"{r.imports['ok']}/{r.imports['gpu']}/{r.imports['dep']}" if r.imports else "-",
                f"{r.seconds:.0f}",
            )
        )
    total_sites = sum(r.model_sites for r in results)
    total_ported = sum(r.model_ported for r in results)
    total_as_is = sum(r.model_as_is for r in results)
    rows.append(
        (
            "TOTAL",
            sum(r.files for r in results),
            total_sites,
            total_ported,
            total_as_is,
            f"{100 * (total_ported + total_as_is) / total_sites:.0f}%" if total_sites else "-",
            sum(r.test_sites for r in results),
            sum(r.test_ported for r in results),
            sum(r.changed for r in results),
            "",
            sum(len(r.stray) for r in results),
            sum(len(r.dead_gpu) for r in results),
            sum(len(r.crashes) for r in results),
            sum(len(r.fully_ported) for r in results),
            sum(len(r.still_gpu) for r in results),
            sum(len(r.probes_kept) for r in results),
            "",
            "",
        )
    )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for row in (head, *rows):
        print(
            "  ".join(
                str(x).rjust(w) if i else str(x).ljust(w)
                for i, (x, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    reasons = collections.Counter()
    for r in results:
        reasons.update(r.refusals)
    if total_sites:
        print(
            f"\nshare = (ported + as is) / model sites; ported alone: {total_ported}/{total_sites} = "
            f"{100 * total_ported / total_sites:.0f}%. 'as is': kept byte-identical because it needs no "
            "change on a TPU host (SDPA backend switches, probes of torch SDPA's kernels on made-up tensors)"
        )
    print("\nTop refusal reasons in model code (all packages):")
    for reason, count in reasons.most_common(15):
        print(f"  {count:4d}  {reason}")
    print("\nRefusals in model code by package (rule and kind: count):")
    for r in results:
        if r.refusals:
            by_rule = collections.Counter(reason.split(":", 1)[0] for reason in r.refusals.elements())
            print(f"  {r.name}: " + ", ".join(f"{k} {n}" for k, n in sorted(by_rule.items())))
    for r in results:
        for label, items in (
            ("run-time patches of source APIs (SDPA calls go to the patch-aware drop-in)", r.patches),
            ("crashes", r.crashes),
            ("stray changes", r.stray),
            ("dead GPU imports (read before the port, unread after)", r.dead_gpu),
            (
                "unread GPU imports kept in a try that still probes the library (its flag is read)",
                r.dead_probes,
            ),
            ("not compiling", r.not_compiling),
            ("not idempotent", r.not_idempotent),
            ("fully ported, still importing GPU modules a TPU host lacks", r.still_gpu),
            ("fully ported, keeping only guarded probes of the installed GPU library", r.probes_kept),
            ("fully ported modules whose import reached a GPU module", r.gpu_on_import),
        ):
            if items:
                print(f"\n{r.name} {label} ({len(items)}):")
                for item in items[:8]:
                    print(f"  {item}")


def main(argv: list[str] | None = None) -> int:
    """Run the packages and the speed measurement; print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", help="comma-separated names from the pinned list (default: all)")
    parser.add_argument(
        "--set",
        choices=("known", "fresh", "all"),
        default="known",
        help="the PyPI packages the rules were tuned on (known), the git repositories of FRESH, or both",
    )
    parser.add_argument(
        "--speed-sites", type=int, default=20000, help="sites in the generated file (0: skip)"
    )
    parser.add_argument(
        "--no-import-check", action="store_true", help="skip importing the fully ported modules"
    )
    args = parser.parse_args(argv)
    base = os.environ.get("FLASHPORT_BENCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flashport-bench"
    )
    cache = os.path.join(base, "real_repos")
    wanted = set(args.packages.split(",")) if args.packages else None
    gpu_modules = tuple(sorted({m for r in registry.all_rules() for m in r.GPU_MODULES}))
    results = []
    chosen = {"known": PACKAGES, "fresh": FRESH, "all": PACKAGES + FRESH}[args.set]
    for name, version in chosen:
        if wanted and name not in wanted and name.split("/")[-1] not in wanted:
            continue
        try:
            result = run_package(name, version, cache)
        except RuntimeError as err:
            print(f"{name}=={version}: not fetched ({err})", file=sys.stderr)
            continue
        if not args.no_import_check:
            import_check(result, gpu_modules)
        results.append(result)
        print(
            f"... {name}: {result.model_ported}/{result.model_sites} model sites ported, {result.model_as_is} as is",
            file=sys.stderr,
            flush=True,
        )
    report(results)
    if args.speed_sites:
        wall, cpu, size = speed(args.speed_sites)
        print(
            f"\nSpeed: {args.speed_sites} sites ({size / 1e6:.2f} MB) in {wall:.1f} s wall, {cpu:.1f} s CPU: "
            f"{1000 * cpu / args.speed_sites:.2f} ms CPU a site (goal <= 1 ms; 20,000 sites < 20 s)"
        )
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
