"""Ctrl-C (SIGINT to the whole process group, as a terminal sends it) and SIGTERM: the real CLI stops
within 2 s with its workers, without a traceback, exits 128 + signum, names the files written and
not reached, and leaves every file either untouched or completely ported."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from flashport.rewriter.app import interactive
from flashport.rewriter.app.interrupts import Interrupted, stop_on_signals
from flashport.rewriter.app.writes import WriteLog

SITE = "def f{i}_{j}(q, k, v):\n    return flash_attn_func(q, k, v, causal=True, softmax_scale=0.{j}1)\n\n\n"
PAD = "def pad{i}_{j}(x):\n    return x + {j}\n\n\n"


def make_tree(root, files: int, sites: int = 6, pads: int = 40, dense: int = 0):
    """``files`` modules, each with ``sites`` flash-attn calls and ``pads`` plain functions, and
    with ``dense`` > 0 one more module holding that many calls (slow to port whatever the core count)."""
    root.mkdir()
    for i in range(files):
        body = "from flash_attn import flash_attn_func\n\n\n"
        body += "".join(SITE.format(i=i, j=j) for j in range(sites))
        body += "".join(PAD.format(i=i, j=j) for j in range(pads))
        (root / f"m{i:03d}.py").write_text(body)
    if dense:
        body = "from flash_attn import flash_attn_func\n\n\n"
        body += "".join(SITE.format(i="dense", j=j) for j in range(dense))
        (root / "dense.py").write_text(body)
    return {p.name: p.read_bytes() for p in root.glob("*.py")}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Two generated trees: one slow to scan (the scan is interrupted), one with many small files
    (the writes are interrupted)."""
    base = tmp_path_factory.mktemp("interrupts")
    return {
        "scan": (base / "scan", make_tree(base / "scan", files=60, dense=5000)),
        "write": (base / "write", make_tree(base / "write", files=300, sites=1, pads=0)),
    }


def fresh_copy(tmp_path, trees, which):
    source, original = trees[which]
    root = tmp_path / which
    shutil.copytree(source, root)
    return root, original


class Ports:
    """The full port of each file (the engine's output for the original bytes), computed when needed."""

    def __init__(self, root, original):
        self.root, self.original, self.cache = root, original, {}

    def __getitem__(self, name):
        if name not in self.cache:
            from flashport import rules as registry
            from flashport.rewriter.engine.pipeline import transform_source
            from flashport.rules.base import RuleOptions

            options = RuleOptions(format_rewrites=True)  # what the CLI writes
            done = transform_source(self.original[name], str(self.root / name), registry.all_rules(), options)
            assert done.new is not None
            self.cache[name] = done.new
        return self.cache[name]


def cli(*args, jobs: int = 2):
    return [
        sys.executable,
        "-m",
        "flashport",
        *map(str, args),
        "--isolated",
        "--jobs",
        str(jobs),
        "--no-color",
    ]


def start(argv):
    """The CLI in a new session (its own process group, as a terminal's foreground job)."""
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE, start_new_session=True
    )


def stop(proc, signum, whole_group: bool):
    """Send ``signum`` (to the process group, as Ctrl-C does, or to the main process only, as
    ``kill`` does); return (seconds until the main process and every worker are gone, stderr)."""
    sent = time.monotonic()
    if whole_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"still running 30 s after {signal.Signals(signum).name}") from None
    while True:  # workers are in the same process group; wait for the group to empty
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() - sent > 10:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("worker processes outlived the run")
        time.sleep(0.01)
    return time.monotonic() - sent, err.decode()


def check_tree(root, original):
    """Every file is the original or its full port, and nothing else is there; returns the names
    of the ported files."""
    ports, done = Ports(root, original), set()
    for path in root.iterdir():
        assert path.name in original, f"stray file {path.name}"
        data = path.read_bytes()
        if data != original[path.name]:
            assert data == ports[path.name], f"{path.name} is half-written"
            done.add(path.name)
    return done


def listed(err: str, label: str) -> set[str]:
    """The file names the interrupted run's summary lists after ``label:``."""
    return {os.path.basename(line.split(": ", 1)[1]) for line in err.splitlines() if f"  {label}: " in line}


def wait_for(predicate, proc, limit=120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def interrupt_the_scan(tmp_path, trees, argv, signum, whole_group):
    root, original = fresh_copy(tmp_path, trees, "scan")
    proc = start(cli(*argv(root)))
    time.sleep(1.5)  # imports done, the workers busy porting
    assert proc.poll() is None, "the run ended before it could be interrupted; make the tree larger"
    took, err = stop(proc, signum, whole_group)
    assert proc.returncode == 128 + signum, err
    assert took < 2.0, f"took {took:.2f} s to stop"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"interrupted by {signal.Signals(signum).name} during the scan; no file was written" in err
    assert check_tree(root, original) == set()


def test_ctrl_c_during_the_scan_stops_fast_and_writes_nothing(tmp_path, trees):
    interrupt_the_scan(tmp_path, trees, lambda root: ("rewrite", root, "--write"), signal.SIGINT, True)


def test_sigterm_to_the_main_process_stops_the_workers_too(tmp_path, trees):
    interrupt_the_scan(tmp_path, trees, lambda root: ("scan", root), signal.SIGTERM, False)


def test_ctrl_c_during_the_write_names_written_and_not_reached(tmp_path, trees):
    root, original = fresh_copy(tmp_path, trees, "write")
    first = root / "m000.py"
    proc = start(cli("rewrite", root, "--write"))
    assert wait_for(lambda: first.read_bytes() != original["m000.py"], proc), "no write seen"
    took, err = stop(proc, signal.SIGINT, whole_group=True)
    assert "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert took < 2.0, f"took {took:.2f} s to stop"
    done = check_tree(root, original)
    assert listed(err, "written") == done and "m000.py" in done
    not_reached = listed(err, "not reached")
    assert not_reached == set(original) - done and not_reached, "the write was not interrupted"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_interrupt_write_at_random_points(tmp_path, trees, seed):
    """SIGINT or SIGTERM at a random moment of a --write run (scan or write): each file old or new,
    and the summary's list of written files is exactly the files that changed."""
    rng = random.Random(seed)
    root, original = fresh_copy(tmp_path, trees, "write")
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    proc = start(cli("rewrite", root, "--write", jobs=rng.choice([1, 2])))
    first = root / "m000.py"
    if rng.random() < 0.3:
        time.sleep(rng.uniform(0.5, 3.0))
    else:
        wait_for(lambda: first.read_bytes() != original["m000.py"], proc)
        time.sleep(rng.uniform(0, 2.0))
    if proc.poll() is not None:
        proc.communicate()
        assert check_tree(root, original) == set(original)
        return
    took, err = stop(proc, signum, whole_group=signum == signal.SIGINT)
    assert "Traceback" not in err, err
    done = check_tree(root, original)
    if proc.returncode == 0:  # the signal came after the last write
        assert done == set(original)
        return
    assert proc.returncode == 128 + signum and took < 2.0, (proc.returncode, took, err)
    assert listed(err, "written") == done


def test_interactive_interrupt_applies_the_answers_given_so_far(tmp_path):
    """Ctrl-C at the third prompt of a file: the two sites accepted before it are written (and
    only they), the run says so, and reviewing again offers the unanswered sites."""
    from flashport import rules as registry
    from flashport.rewriter.app.runner import run
    from flashport.rules.base import RuleOptions

    make_tree(tmp_path / "t", files=2, sites=4, pads=0)
    paths = sorted(str(p) for p in (tmp_path / "t").glob("*.py"))
    rules, options = registry.all_rules(), RuleOptions()
    results = list(run(paths, rules, options, jobs=1, cache=False))
    answers = iter(["y", "y"])

    def ask(_prompt):
        answer = next(answers, None)
        if answer is None:
            raise Interrupted(signal.SIGINT)
        return answer

    log = WriteLog()
    with pytest.raises(Interrupted):
        interactive.review(results, rules, options, ask=ask, console=_quiet_console(), log=log)
    assert log.written == [paths[0]] and log.not_reached() == [paths[1]]
    summary = log.interrupted("SIGINT")
    assert "answers given so far were applied" in summary and f"written: {paths[0]}" in summary
    again = list(run(paths, rules, options, jobs=1, cache=False))
    first = [s for s in again[0].sites if s.status == "rewrite"]
    assert len(first) == 2  # the two unanswered sites of the first file
    assert [s.status for s in again[1].sites].count("rewrite") == 4


def test_signal_inside_a_held_write_waits_for_it_to_finish():
    """SIGINT raised while a file is written is delivered after the write, not in the middle."""
    from flashport.rewriter.app import interrupts

    events = []
    with pytest.raises(Interrupted) as caught, stop_on_signals():
        with interrupts.held():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # give the handler every chance to run early
                events.append(1)
            events.append("end of write")
    assert events[-1] == "end of write" and caught.value.exit_code == 130


def _quiet_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), no_color=True)


def test_ctrl_c_at_an_interactive_prompt_of_the_real_cli(tmp_path):
    """Two answers, then Ctrl-C at the third prompt: exit 130, no traceback, the two accepted sites
    are written and the message says the answers were applied."""
    original = make_tree(tmp_path / "t", files=1, sites=4, pads=0)
    path = tmp_path / "t" / "m000.py"
    proc = start(cli("rewrite", path, "--interactive", jobs=1))
    shown = b""
    os.set_blocking(proc.stdout.fileno(), False)
    answered = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        shown += proc.stdout.read() or b""
        prompts = shown.count(interactive.PROMPT.encode())
        if prompts == 3:
            break
        if prompts > answered:
            proc.stdin.write(b"y\n")
            proc.stdin.flush()
            answered += 1
        time.sleep(0.01)
    assert shown.count(interactive.PROMPT.encode()) == 3, shown.decode()
    took, err = stop(proc, signal.SIGINT, whole_group=True)
    assert proc.returncode == 130 and took < 2.0 and "Traceback" not in err, err
    assert "the answers given so far were applied" in err and f"written: {path}" in err
    now = path.read_text()
    assert now != original["m000.py"].decode()
    assert now.count("flash_attn_func(q, k, v") == 2  # two accepted, two left as they were
    compile(now, str(path), "exec")
