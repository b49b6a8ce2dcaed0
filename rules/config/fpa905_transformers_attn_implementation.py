"""FPA905 transformers-attn-implementation: ``attn_implementation="flash_attention_2"`` -> flashport (opt-in).

Opt-in: FPA901 reports the same strings and, listed first, answers for them by default. Enable the
rewrite with ``flashport rewrite --ignore FPA901`` (or ``--select FPA905,...``).

What it rewrites:
  the strings ``"flash_attention_2"`` / ``"flash_attention_3"`` where they **set** transformers'
  attention implementation:

  * a keyword argument ``attn_implementation="flash_attention_2"`` of any call
    (``from_pretrained``, ``from_config``, ``AutoConfig...``);
  * the argument of ``model.set_attn_implementation("flash_attention_2")``;
  * an assignment to ``attn_implementation`` / ``x.attn_implementation`` / ``x._attn_implementation``;
  * a dict entry ``{"attn_implementation": "flash_attention_2"}`` (kwargs tables).

  Each becomes ``flashport.integrations.transformers.ATTN_IMPLEMENTATION`` (the string
  ``"flashport"``); the rewritten file imports ``flashport.integrations.transformers``, which
  registers flashport's attention function and mask builder with transformers' registries at
  import time, so the name is valid before the model is built.

Semantics mapping:
  transformers calls the registered function with ``[B, H, S, D]`` tensors, the SDPA-style mask
  (boolean, True = attend, with padding, causal and sliding window folded in) or ``None`` plus
  ``is_causal`` (top-left, as in the SDPA integration), ``scaling`` and ``softcap``; it runs
  ``flashport.torch.attention(..., layout="BHSD", align="top_left")``. GQA needs no ``repeat_kv``.
  Outputs match ``attn_implementation="sdpa"`` (and ``"eager"`` on non-padding rows) to float32
  round-off (tests/test_rules_torch_catalogue.py).

What it refuses:
  * a setting passed to a call with ``trust_remote_code`` (not literally ``False``): the model's own
    remote code (``modeling_*.py``) often dispatches on the string itself
    (``ATTENTION_CLASSES[config._attn_implementation]``) and would raise ``KeyError: 'flashport'``;
  * every setting in a file whose own code dispatches on the same string (a comparison, a dict key,
    a ``match`` case ...: any non-setting occurrence) or that loads remote code with one: ``"flashport"``
    would fall through or raise ``KeyError`` there (per-file phase, :meth:`settle`).

  The same strings in any other position (comparisons such as
  ``config._attn_implementation == "flash_attention_2"``, dispatch tables, messages) are reported,
  not rewritten: changing them would change the code's branching. At run time the flashport function
  raises for attention sinks (``s_aux``) and ``head_mask``; attention dropout in training is passed
  on to ``flashport.torch.attention(dropout_p=...)``.

Example::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flash_attention_2")
    # becomes
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=flashport.integrations.transformers.ATTN_IMPLEMENTATION)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Report, Rewrite, Rule, register
from flashport.rules.common import node_context
from flashport.rules.common.calls import dotted
from flashport.rules.common.literals import literal_string

MODULE = "flashport.integrations.transformers"
NAMES = ("attn_implementation", "_attn_implementation")


def setting_context(node: cst.SimpleString, ctx) -> bool:
    """True when the string literal sets transformers' attention implementation."""
    up = node_context.parent(node, ctx)
    if isinstance(up, cst.Arg) and up.value is node:
        if up.keyword is not None:
            return up.keyword.value in NAMES
        call = node_context.parent(up, ctx)
        return (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == "set_attn_implementation"
            and bool(call.args)
            and call.args[0] is up
        )
    if isinstance(up, cst.Assign) and up.value is node:
        for target in up.targets:
            t = target.target
            name = (
                t.value if isinstance(t, cst.Name) else t.attr.value if isinstance(t, cst.Attribute) else None
            )
            if name not in NAMES:
                return False
        return True
    if isinstance(up, cst.DictElement) and up.value is node:
        return literal_string(up.key) in NAMES
    return False


@register
class TransformersAttnImplementation(Rule):
    """Point transformers' ``attn_implementation`` settings at flashport's registered implementation."""

    CODE = "FPA905"
    NAME = "transformers-attn-implementation"
    API = "transformers attn_implementation (rewrite)"
    FRAMEWORK = "torch"
    STRINGS = ("flash_attention_2", "flash_attention_3")
    TARGET = MODULE + ".ATTN_IMPLEMENTATION"

    def check_string(self, node, value, ctx):
        """Rewrite setting positions; report every other occurrence."""
        if setting_context(node, ctx):
            if _remote_code(node, ctx):
                return Report(
                    f"{value!r} is passed with trust_remote_code: the model's own remote code may dispatch "
                    "on the string (ATTENTION_CLASSES[config._attn_implementation]) and would raise "
                    "KeyError: 'flashport'; not rewritten"
                )
            return Rewrite(
                dotted(self.TARGET),
                imports=(MODULE,),
                notes=(f"{value!r} -> 'flashport' (registered by importing {MODULE})",),
            )
        return Report(
            f"configuration string {value!r} selects a CUDA flash-attention kernel; it is not "
            "setting attn_implementation here (comparison or table), so it is not rewritten"
        )

    def settle(self, sites, ctx) -> str | None:
        """Refuse every setting in a file that also dispatches on the watched strings itself."""
        reads = [s for s in sites if s.rule == self.CODE and s.kind == "string" and s.status == "refused"]
        if not reads or not any(s.rule == self.CODE and s.status == "rewrite" for s in sites):
            return None
        first = min(reads, key=lambda s: (s.line, s.column))
        if "trust_remote_code" in first.reason:
            return (
                f"line {first.line} loads remote model code with this setting, whose dispatch on the string "
                "may not know 'flashport' (KeyError); no setting in this file is rewritten"
            )
        return (
            f"this file dispatches on {first.api!r} itself (line {first.line}): 'flashport' would not "
            "match there (KeyError or a different branch); not rewritten"
        )


def _remote_code(node: cst.SimpleString, ctx) -> bool:
    """True when ``node`` is an argument of a call that passes ``trust_remote_code`` (not ``False``)."""
    up = node_context.parent(node, ctx)
    call = node_context.parent(up, ctx) if isinstance(up, cst.Arg) else None
    if not isinstance(call, cst.Call):
        return False
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "trust_remote_code":
            return not (isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None"))
        if arg.star == "**":  # unknown keywords could hold it: only a literal dict is read
            if isinstance(arg.value, cst.Dict) and any(
                literal_string(e.key) == "trust_remote_code"
                for e in arg.value.elements
                if isinstance(e, cst.DictElement)
            ):
                return True
    return False
