"""The jaxpr pass on transformers' Flax models (small random configs, no downloads).

transformers 4.57 still ships Flax BERT, RoBERTa, GPT-2, GPT-Neo, Llama and Mistral (removed in v5:
the tests skip there; GPT-2, GPT-Neo, RoBERTa and Mistral run under ``-m slow``). Each model runs on a padded batch (the second row has padding), so the
attention mask reaches the pass; every layer's attention must be fused, and the fused model's last
hidden state and its gradients w.r.t. all parameters must equal the unmodified model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jaxpr_util import assert_fused

import flashport

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FlaxBertModel"):
    pytest.skip("this transformers has no Flax models (removed in v5)", allow_module_level=True)

B, T, E, HEADS, VOCAB = 2, 16, 32, 4, 64
LENGTHS = (T, 10)  # the second sequence is padded after 10 tokens


def _inputs():
    ids = jax.random.randint(jax.random.PRNGKey(3), (B, T), 0, VOCAB)
    mask = (jnp.arange(T)[None, :] < jnp.array(LENGTHS)[:, None]).astype(jnp.int32)
    return ids, mask


def _config(name):
    common = {"vocab_size": VOCAB, "intermediate_size": 64, "max_position_embeddings": 40}
    if name == "bert":
        return transformers.BertConfig(
            hidden_size=E, num_hidden_layers=2, num_attention_heads=HEADS, **common
        )
    if name == "roberta":
        return transformers.RobertaConfig(
            hidden_size=E, num_hidden_layers=2, num_attention_heads=HEADS, **common
        )
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_head=HEADS, n_embd=E, vocab_size=VOCAB, n_positions=40)
    if name == "gptneo":  # one global and one local (windowed) layer
        return transformers.GPTNeoConfig(
            hidden_size=E,
            num_layers=2,
            num_heads=HEADS,
            attention_types=[[["global", "local"], 1]],
            window_size=5,
            **common,
        )
    if name == "llama":  # GQA: 4 query heads over 2 kv heads
        return transformers.LlamaConfig(
            hidden_size=E, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2, **common
        )
    if name == "mistral":  # GQA and a sliding window shorter than the sequence
        return transformers.MistralConfig(
            hidden_size=E,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            sliding_window=6,
            **common,
        )
    raise AssertionError(name)


MODELS = {
    "bert": "FlaxBertModel",
    "roberta": "FlaxRobertaModel",
    "gpt2": "FlaxGPT2Model",
    "gptneo": "FlaxGPTNeoModel",
    "llama": "FlaxLlamaModel",
    "mistral": "FlaxMistralModel",
}


# BERT (the padded-batch encoder) and Llama (GQA) in the default run; the others (~20 s each on the
# shared 2 cores, compile-bound) under -m slow.
DEFAULT = ("bert", "llama")


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]
)
def test_transformers_flax_model_fuses_every_layer_with_output_and_gradient_parity(name):
    model = getattr(transformers, MODELS[name])(_config(name), seed=0)
    ids, mask = _inputs()

    def f(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).last_hidden_state

    assert_fused(f, (model.params, ids, mask), 2, argnums=(0,), atol=2e-5)
    report = flashport.find_attention(f)(model.params, ids, mask)
    assert not report.near_misses, report
    if name in ("llama", "mistral"):  # the repeated K/V reach the kernel un-repeated (contract GQA)
        assert all(site.gqa == 2 for site in report.matches), report
