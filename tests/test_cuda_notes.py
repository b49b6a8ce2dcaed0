"""CUDA-only lines beside a port are reported as notes on the port (text, JSON and HTML read the
site's notes), each with its line; code that answers on any host (``torch.cuda.is_available()``) and
functions without a port are not."""

from __future__ import annotations

import textwrap

from flashport import rules as registry
from flashport.rewriter.engine.pipeline import transform_source
from flashport.rules.base import RuleOptions

SOURCE = textwrap.dedent("""\
    import torch
    from flash_attn import flash_attn_func


    def attend(q, k, v):
        assert q.device.type == "cuda"
        major, _ = torch.cuda.get_device_capability()
        mask = torch.ones(4, device="cuda")
        q = q.cuda()
        k = k.to("cuda:0")
        here = torch.device("cuda")
        if torch.cuda.is_available():
            pass
        return flash_attn_func(q, k, v, causal=major >= 8)


    def elsewhere(x):
        return x.cuda()
""")


def test_cuda_only_lines_are_noted_on_the_port_beside_them():
    result = transform_source(SOURCE.encode(), "m.py", registry.all_rules(), RuleOptions())
    (site,) = [s for s in result.sites if s.status == "rewrite"]
    noted = [n for n in site.notes if n.startswith("CUDA-only code beside this port")]
    assert [int(n.split("line ")[1].split(":")[0]) for n in noted] == [6, 7, 8, 9, 10, 11]
    assert "`q = q.cuda()`" in noted[3]
    assert not any("is_available" in n or "line 18" in n for n in site.notes)


def test_a_branch_on_the_device_type_is_not_cuda_only():
    source = SOURCE.replace('assert q.device.type == "cuda"', 'if q.device.type == "cuda":\n        pass')
    result = transform_source(source.encode(), "m.py", registry.all_rules(), RuleOptions())
    (site,) = [s for s in result.sites if s.status == "rewrite"]
    assert not any("device.type" in n for n in site.notes)
    assert any("get_device_capability" in n for n in site.notes)


def test_only_statements_holding_a_port_are_searched(monkeypatch):
    """The note pass is linear in the file: statements without a port are never walked, however
    many there are (each of these would also hold a CUDA-only line)."""
    from flashport.rewriter.engine import cuda_notes

    others = "".join(f"\n\ndef helper_{i}(x):\n    return x.cuda()\n" for i in range(300))
    seen = []
    real = cuda_notes._cuda_only
    monkeypatch.setattr(cuda_notes, "_cuda_only", lambda node: seen.append(node) or real(node))
    result = transform_source((SOURCE + others).encode(), "m.py", registry.all_rules(), RuleOptions())
    (site,) = [s for s in result.sites if s.status == "rewrite"]
    assert any("`q = q.cuda()`" in n for n in site.notes)
    assert not any("helper_" in n or "return x.cuda()" in n for n in site.notes)
    assert 0 < len(seen) < 200, len(seen)
