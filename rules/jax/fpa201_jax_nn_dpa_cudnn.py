"""FPA201 jax-nn-dpa-cudnn: ``jax.nn.dot_product_attention(implementation="cudnn")`` -> ``flashport.attention``.

What it rewrites:
  ``jax.nn.dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
  is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
  implementation="cudnn", return_residual=False)``. Calls with ``implementation`` None/"xla"
  already run everywhere and are left alone (not reported).

Semantics mapping:
  layout ``[B, T, N, H]`` -> ``layout="BSHD"``; ``is_causal`` is top-left (``tril(ones(T, S))``) ->
  ``causal=..., align="top_left"``; ``scale`` (None = 1/sqrt(H)) -> ``scale``; ``mask`` (bool, True =
  attend) -> ``mask``; ``bias`` (additive) -> ``bias``; both broadcast to ``[B, N, T, S]`` like the
  contract's ``[B, Hq, Sq, Sk]``; ``local_window_size=(l, r)`` (inclusive, top-left anchored; an int
  ``w`` means ``(w, w)``) -> ``window=(l, r)`` with ``align="top_left"``; GQA (N a multiple of K,
  contiguous groups) is the same. ``bias``/``mask`` are positional since jax 0.4.33 and
  keyword-only in 0.4.31: arguments are bound against ``jax-version``.

Drop-in:
  a call whose ``implementation`` is a variable or a forwarded parameter, a ``*args``/``**kwargs``
  splat (a wrapper forwarding ``implementation``), ``query_seq_lengths``/``key_value_seq_lengths``,
  ``return_residual`` and a non-literal ``local_window_size`` keep their arguments and call
  ``flashport.integrations.jax_nn_compat.dot_product_attention`` (jax.nn's signature): an
  ``implementation="xla"`` there still runs jax.nn's XLA path, as the code asks; None and
  ``"cudnn"`` run ``flashport.attention`` with jax.nn's meaning (padding lengths as a mask, lse
  ``[B, T, N]``).

What it refuses:
  calls without ``query``/``key``/``value``; unknown arguments.

Known problems:
  jax.nn fills masked logits with a large finite value, so a fully masked row returns the mean of
  ``value``; the contract returns 0 for such rows. The contract needs rank-4 inputs (jax.nn also
  accepts ``[T, N, H]``).

Example::

    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    # becomes
    out = flashport.attention(q, k, v, causal=True, align="top_left", layout="BSHD")
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.binding import Signature
from flashport.rules.common.calls import build_call, number, on_drop_in, string, tuple_of
from flashport.rules.common.literals import is_none, literal_bool, literal_number, literal_string


def jax_signature(version: tuple[int, ...]) -> Signature:
    """``jax.nn.dot_product_attention``'s signature at jax ``version``."""
    keyword_only: tuple[str, ...] = ("scale", "is_causal")
    positional: tuple[str, ...]
    if version >= (0, 4, 33):
        positional = ("query", "key", "value", "bias", "mask")
        keyword_only += ("query_seq_lengths", "key_value_seq_lengths")
    else:
        positional = ("query", "key", "value")
        keyword_only = ("bias", "mask") + keyword_only
    if version >= (0, 4, 35):
        keyword_only += ("local_window_size",)
    keyword_only += ("implementation",)
    if version >= (0, 9, 0):
        keyword_only += ("return_residual",)
    return Signature(positional, keyword_only)


DROP_IN = "flashport.integrations.jax_nn_compat"
# what the drop-in states that the explicit call cannot (other refusals -- arguments that do not
# bind at the configured jax version, missing tensors -- stand)
_DROP_IN_TAKES = ("implementation=", "seq_lengths", "return_residual", "local_window_size", "splat")


@register
class JaxNNDotProductAttentionCudnn(Rule):
    """Rewrite ``jax.nn.dot_product_attention(implementation="cudnn")`` to ``flashport.attention``."""

    CODE = "FPA201"
    NAME = "jax-nn-dpa-cudnn"
    SOURCES = ("jax.nn.dot_product_attention", "jax._src.nn.functions.dot_product_attention")
    TARGET = "flashport.attention"

    def check_call(self, call, ctx):
        """Only ``implementation="cudnn"`` calls are GPU-only; map them to the contract. A call whose
        implementation is only known at run time (a variable, a forwarded parameter, a splat), or
        that the contract call cannot state (padding lengths, the lse residual, a computed window),
        keeps its arguments and calls the drop-in of jax.nn's signature."""
        try:
            return self._explicit(call, ctx)
        except Refuse as refusal:
            if not any(word in refusal.reason for word in _DROP_IN_TAKES):
                raise
            note = (
                f"drop-in {DROP_IN}.dot_product_attention (jax.nn's signature; implementation='xla' "
                f"stays XLA, None/'cudnn' run flashport.attention): {refusal.reason.split(';')[0]}"
            )
            return on_drop_in(call, f"{DROP_IN}.dot_product_attention", note)

    def _explicit(self, call, ctx):
        """The explicit ``flashport.attention`` call (None: a call that runs everywhere).

        Raises:
          Refuse: for what that call cannot state.
        """
        bound = jax_signature(ctx.options.jax_version).bind(call, self.API)
        value = {name: arg.value for name, arg in bound.items()}
        implementation = value.get("implementation")
        if is_none(implementation):
            return None
        literal = literal_string(implementation)
        if literal is None:
            raise Refuse("implementation= is not a string literal (known at run time)")
        if literal != "cudnn":
            return None
        for name in ("query", "key", "value"):
            if name not in value:
                raise Refuse(f"{self.API} call without {name!r}")
        for name in ("query_seq_lengths", "key_value_seq_lengths"):
            if not is_none(value.get(name)):
                raise Refuse(f"{name}: per-batch padding lengths are not mapped to the contract yet")
        residual = value.get("return_residual")
        if residual is not None and literal_bool(residual) is not False:
            raise Refuse("return_residual: jax.nn's lse is [B, T, N], flashport's is [B, N, T]")
        scale = value.get("scale")
        keywords: list = [
            ("scale", cst.Name("None") if is_none(scale) else scale),
            ("causal", value.get("is_causal", cst.Name("False"))),
        ]
        window = value.get("local_window_size")
        if not is_none(window):
            keywords.append(("window", _window(window)))
        for name in ("bias", "mask"):
            if not is_none(value.get(name)):
                keywords.append((name, value[name]))
        keywords += [("align", string("top_left")), ("layout", string("BSHD"))]
        node = build_call(self.TARGET, [value["query"], value["key"], value["value"]], keywords, call)
        return Rewrite(node)


def _window(node: cst.BaseExpression) -> cst.BaseExpression:
    single = literal_number(node)
    if isinstance(single, int) and single >= 0:
        return tuple_of(number(single), number(single))
    if isinstance(node, (cst.Tuple, cst.List)) and len(node.elements) == 2:
        values = [v for e in node.elements if isinstance(v := literal_number(e.value), int) and v >= 0]
        if len(values) == 2:
            return tuple_of(*(number(v) for v in values))
    raise Refuse("local_window_size is not a literal int or (left, right) pair")
