"""FPA902 use-flash-attention-2: transformers' legacy ``use_flash_attention_2=True`` -> flashport.

What it rewrites:
  the keyword ``use_flash_attention_2=True`` of ``from_pretrained`` / ``from_config`` on the
  transformers Auto classes and ``PreTrainedModel`` (transformers <= 4.3x popped it and meant
  ``attn_implementation="flash_attention_2"``). It is replaced by
  ``attn_implementation=flashport.integrations.transformers.ATTN_IMPLEMENTATION`` (see FPA905).

Semantics mapping:
  as FPA905: the model's attention layers run ``flashport.torch.attention`` with the SDPA-style
  masks transformers builds.

What it refuses:
  a call that also passes ``attn_implementation=`` (the two would conflict), a non-literal value
  (``use_flash_attention_2=flag``), and ``**kwargs`` splats next to it. ``use_flash_attention_2=False``
  is left alone (no finding). Calls on concrete model classes (``LlamaForCausalLM.from_pretrained``)
  are not matched: only the Auto classes and ``PreTrainedModel`` are known statically.

Example::

    model = AutoModelForCausalLM.from_pretrained(name, use_flash_attention_2=True)
    # becomes
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=flashport.integrations.transformers.ATTN_IMPLEMENTATION)
"""

from __future__ import annotations

import libcst as cst

from flashport.rules.base import Refuse, Rewrite, Rule, register
from flashport.rules.common.calls import dotted
from flashport.rules.common.literals import literal_bool

MODULE = "flashport.integrations.transformers"
AUTO = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMaskedLM",
    "AutoModelForPreTraining",
    "AutoModelForMultipleChoice",
    "AutoModelForVision2Seq",
    "AutoModelForImageTextToText",
    "AutoModelForSpeechSeq2Seq",
    "AutoModelForImageClassification",
    "AutoModelForCTC",
    "AutoModelForAudioClassification",
    "PreTrainedModel",
)
METHODS = ("from_pretrained", "from_config", "_from_config")


@register
class UseFlashAttention2(Rule):
    """Replace transformers' legacy ``use_flash_attention_2=True`` with flashport's implementation."""

    CODE = "FPA902"
    NAME = "use-flash-attention-2"
    API = "transformers use_flash_attention_2=True"
    FRAMEWORK = "torch"
    SOURCES = tuple(f"transformers.{cls}.{m}" for cls in AUTO for m in METHODS)
    TRIGGERS = (b"use_flash_attention_2",)
    TARGET = MODULE + ".ATTN_IMPLEMENTATION"

    def check_call(self, call, ctx):
        """Swap the keyword when it is literally True and nothing conflicts."""
        index = next(
            (
                i
                for i, a in enumerate(call.args)
                if a.keyword is not None and a.keyword.value == "use_flash_attention_2"
            ),
            None,
        )
        if index is None:
            return None
        arg = call.args[index]
        if literal_bool(arg.value) is False:
            return None
        if literal_bool(arg.value) is None:
            raise Refuse(
                f"use_flash_attention_2={ctx.code(arg.value)} is not a literal: whether flash-attn is selected is unknown"
            )
        if any(a.keyword is not None and a.keyword.value == "attn_implementation" for a in call.args):
            raise Refuse(
                "use_flash_attention_2=True together with attn_implementation=: resolve the conflict first"
            )
        if any(a.star for a in call.args):
            raise Refuse("**kwargs splat next to use_flash_attention_2: attn_implementation may be set twice")
        new = arg.with_changes(keyword=cst.Name("attn_implementation"), value=dotted(self.TARGET))
        args = list(call.args)
        args[index] = new
        return Rewrite(
            call.with_changes(args=args),
            imports=(MODULE,),
            notes=("use_flash_attention_2=True -> attn_implementation='flashport'",),
        )

    def check_reference(self, node, ctx):
        """``from_pretrained`` used as a value is not a finding."""
        return None
