"""The real TPU compiler (libtpu: XLA:TPU + Mosaic's layout passes, VMEM allocation, LLO) on a CPU host.

``jax.experimental.topologies.get_topology_desc`` gives TPU devices of a topology without any TPU;
``jax.jit(f).trace(*specs_sharded_on_them).lower(lowering_platforms=("tpu",)).compile()`` then runs
the whole TPU compilation, which catches what ``jax.export`` cannot (per-chip dtype legalisation,
VMEM overflow, layout failures). No abstract mesh is set: the kernels must find the chip themselves.

Needs ``jax[tpu]`` at the installed jax version (``pip install "jax[tpu]==<jax version>"``); marked
``tpu_compile`` (not in the default run) and skipped when libtpu is not importable.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import flashport
from flashport.kernels.contract import registry

# A missing libtpu skips the tests, not the module: where the marker is deselected (the default
# tier) nothing is reported as skipped; where it is selected the skip names the fix.
pytestmark = [pytest.mark.tpu_compile]
if importlib.util.find_spec("libtpu") is None:
    pytestmark.append(
        pytest.mark.skip(reason='needs libtpu: pip install "jax[tpu]==<installed jax version>"')
    )
from jax.experimental import topologies  # noqa: E402

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
SEQ = 300  # ragged against every block size

# feature -> (static kwargs, extra array shapes/dtypes, shape overrides)
FEATURES = {
    "causal": (dict(causal=True), {}, {}),
    "gqa": (dict(causal=True), {}, dict(hkv=1)),
    "softcap_window": (dict(softcap=30.0, window=(64, 0)), {}, {}),
    "segments_bias": (
        {},
        dict(
            bias=((2, 4, SEQ, SEQ), jnp.float32),
            q_segment_ids=((2, SEQ), jnp.int32),
            kv_segment_ids=((2, SEQ), jnp.int32),
        ),
        {},
    ),
    # A boolean mask per head: whole [bq, bk] tiles of it (int8 in the kernels).
    "mask": ({}, dict(mask=((2, 4, SEQ, SEQ), jnp.bool_)), {}),
    "bottom_right_sq_ne_sk": (dict(causal=True), {}, dict(sq=SEQ // 2 + 7)),
    "decode_sq1": (dict(causal=True), {}, dict(sq=1)),
    # Dropout (the key is a traced raw uint32[2] key): with GQA and causal, and with every masking feature.
    "dropout_gqa": (dict(causal=True, dropout_rate=0.1), dict(dropout_rng=((2,), jnp.uint32)), dict(hkv=1)),
    "dropout_everything": (
        dict(causal=True, softcap=30.0, window=(64, None), dropout_rate=0.3),
        dict(
            bias=((2, 4, SEQ, SEQ), jnp.float32),
            q_segment_ids=((2, SEQ), jnp.int32),
            kv_segment_ids=((2, SEQ), jnp.int32),
            dropout_rng=((2,), jnp.uint32),
        ),
        {},
    ),
}


@functools.cache
def one_chip(gen):
    """A one-device sharding on a TPU device of generation ``gen`` (from its topology, no TPU needed)."""
    devices = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    assert devices[0].device_kind == KINDS[gen]
    return NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())


def compile_fwd_and_grad(sharding, dtype, feature, backend="pallas_tpu"):
    """Compile the forward and value_and_grad for TPU; returns the two compiled modules' HLO text."""
    assert jax.sharding.get_abstract_mesh().abstract_device is None
    static, extra, shape = FEATURES[feature]
    b, hq, hkv, sq, sk, d = 2, 4, shape.get("hkv", 2), shape.get("sq", SEQ), SEQ, 128
    spec = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=sharding)  # noqa: E731
    q, kv = spec((b, sq, hq, d), jnp.dtype(dtype)), spec((b, sk, hkv, d), jnp.dtype(dtype))
    arrays = {}
    for name, (s, dt) in extra.items():
        s = (
            (s[0], s[1], sq, s[3])
            if name in ("bias", "mask")
            else ((s[0], sq) if name == "q_segment_ids" else s)
        )
        arrays[name] = spec(s, dt)

    def fwd(q, k, v, arrays):
        return flashport.attention(q, k, v, backend=backend, **static, **arrays)

    def loss(q, k, v, arrays):
        return jnp.sum(fwd(q, k, v, arrays).astype(jnp.float32))

    texts = []
    for fn in (fwd, jax.value_and_grad(loss, argnums=(0, 1, 2))):
        compiled = jax.jit(fn).trace(q, kv, kv, arrays).lower(lowering_platforms=("tpu",)).compile()
        texts.append(compiled.as_text())
    return texts


# Every generation x dtype, each with one feature (cycled so every feature meets several chips and
# dtypes), then every feature in the two 16-bit dtypes: 30 configurations, forward and gradient each.
GEN_DTYPE = [
    (g, dt, f)
    for (g, dt), f in zip(
        itertools.product(sorted(TOPOLOGIES), ("float32", "bfloat16", "float16")),
        itertools.cycle(sorted(FEATURES)),
    )
]


@pytest.mark.parametrize("gen,dtype,feature", GEN_DTYPE)
def test_every_generation_and_dtype_compiles(gen, dtype, feature):
    compile_fwd_and_grad(one_chip(gen), dtype, feature, registry.use("pallas_tpu", generation=gen))


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_feature_compiles(feature, dtype):
    compile_fwd_and_grad(one_chip("v6e"), dtype, feature, registry.use("pallas_tpu", generation="v6e"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("gen", sorted(TOPOLOGIES))
def test_dropout_compiles_on_every_generation_and_dtype(gen, dtype):
    # The in-kernel keep-mask hash (uint32 multiply, xor, logical shifts, unsigned compare) must pass
    # Mosaic on every chip, in the forward and both backward kernels.
    backend = registry.use("pallas_tpu", generation=gen)
    fwd, grad = compile_fwd_and_grad(one_chip(gen), dtype, "dropout_gqa", backend)
    assert "flashport_flash_fwd" in fwd
    assert "flashport_flash_dkv" in grad and "flashport_flash_dq" in grad


def test_auto_with_default_generation_compiles():
    # No generation option and no abstract mesh: default blocks, the chip comes from the devices.
    compile_fwd_and_grad(one_chip("v5e"), "bfloat16", "causal", backend="auto")


@pytest.mark.parametrize("gen", ["v4", "v5e", "v6e"])
@pytest.mark.parametrize("hq,hkv", [(32, 4), (16, 1)])
def test_long_gqa_default_blocks_fit_vmem(gen, hq, hkv):
    # The grouped forward holds the G query heads of a group in one step: at S = 8192 with the
    # default blocks its query block is shrunk to fit VMEM (blocks.fit_forward_block_q). Without the
    # shrink v4 (16 MiB VMEM) runs out: "Used 29.54M of 16.00M vmem" for 16 heads on one kv head.
    sharding = one_chip(gen)
    q = jax.ShapeDtypeStruct((1, 8192, hq, 128), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, 8192, hkv, 128), jnp.bfloat16, sharding=sharding)
    backend = registry.use("pallas_tpu", generation=gen)

    def fwd(q, k, v):
        return flashport.attention(q, k, v, causal=True, backend=backend)

    text = jax.jit(fwd).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile().as_text()
    assert "flashport_flash_fwd" in text


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_every_feature_compiles_on_v4_with_default_options(feature):
    # No generation option: the blocks must follow the chip the program is compiled for (v4: 16 MiB
    # VMEM), found from the compile target's devices, not the host (which has no TPU).
    compile_fwd_and_grad(one_chip("v4"), "bfloat16", feature)


# Long sequences, where blocks planned for v6e overflow v4's VMEM or break its Mosaic layout rules:
# (dtype, query heads, kv heads, head dim, static kwargs, extra arrays).
LONG_CASES = {
    "gqa_8_2_causal_bf16": ("bfloat16", 8, 2, 128, dict(causal=True), ()),
    "softcap_window_f32": ("float32", 8, 8, 128, dict(softcap=30.0, window=(256, 0)), ()),
    "segments_bias_bf16": ("bfloat16", 8, 8, 128, {}, ("bias", "segments")),
    "d256_causal_bf16": ("bfloat16", 8, 8, 256, dict(causal=True), ()),
}


@pytest.mark.parametrize("gen", sorted(TOPOLOGIES))
@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_default_blocks_follow_the_target_chip(case, gen):
    dtype, hq, hkv, d, static, extra = LONG_CASES[case]
    sharding, s = one_chip(gen), 4096
    q = jax.ShapeDtypeStruct((1, s, hq, d), jnp.dtype(dtype), sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, s, hkv, d), jnp.dtype(dtype), sharding=sharding)
    arrays = {}
    if "bias" in extra:
        arrays["bias"] = jax.ShapeDtypeStruct((1, hq, s, s), jnp.dtype(dtype), sharding=sharding)
    if "segments" in extra:
        seg = jax.ShapeDtypeStruct((1, s), jnp.int32, sharding=sharding)
        arrays.update(q_segment_ids=seg, kv_segment_ids=seg)

    def loss(q, k, v, arrays):
        return jnp.sum(
            flashport.attention(q, k, v, backend="pallas_tpu", **static, **arrays).astype(jnp.float32)
        )

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(q, kv, kv, arrays)
        .lower(lowering_platforms=("tpu",))
        .compile()
        .as_text()
    )
    assert "flashport_flash_dkv" in text and "flashport_flash_dq" in text


@functools.cache
def eight_chips():
    """A ``seq`` mesh over the 8 chips of a v5e 2x4 topology (no TPU needed)."""
    devices = topologies.get_topology_desc("v5e:2x4", "tpu").devices
    assert len(devices) == 8 and devices[0].device_kind == KINDS["v5e"]
    return jax.sharding.Mesh(np.array(devices), ("seq",))


@pytest.mark.parametrize(
    "backend,seq_layout,segments",
    [("pallas_tpu", "contiguous", False), ("pallas_tpu", "zigzag", True), ("blockwise", "zigzag", True)],
)
def test_ring_attention_compiles_over_8_chips(backend, seq_layout, segments):
    # The sequence-parallel forward and gradient through the whole TPU compiler: K/V move only by
    # collective-permute (no all-gather of the sequence), the kernels fit the chip.
    mesh = eight_chips()
    shard = NamedSharding(mesh, PartitionSpec(None, "seq", None, None))
    q = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16, sharding=shard)
    kv = jax.ShapeDtypeStruct((1, 8192, 2, 128), jnp.bfloat16, sharding=shard)
    seg = jax.ShapeDtypeStruct((1, 8192), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(None, "seq")))
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}

    def fwd(q, k, v, ids):
        return flashport.ring_attention(
            q, k, v, mesh=mesh, axis_name="seq", causal=True, backend=backend, seq_layout=seq_layout, **ids
        )

    def loss(q, k, v, ids):
        return jnp.sum(fwd(q, k, v, ids).astype(jnp.float32))

    for fn in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
        text = jax.jit(fn).trace(q, kv, kv, ids).lower(lowering_platforms=("tpu",)).compile().as_text()
        assert "collective-permute" in text and "all-gather" not in text
        assert ("flashport_flash" in text) == (backend == "pallas_tpu")


def _hlo_lines(text, pattern):
    return [line.strip()[:200] for line in text.splitlines() if re.search(pattern, line)]


def _compile_bshd(gen, b, s, hq, hkv, d=128, **kwargs):
    """The optimized HLO of a BSHD bf16 call with the default options (the chip from the devices),
    inference forward and gradient, for chip ``gen``."""
    sharding = one_chip(gen)
    q = jax.ShapeDtypeStruct((b, s, hq, d), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16, sharding=sharding)
    backend = "pallas_tpu"

    def fwd(q, k, v):
        return flashport.attention(q, k, v, backend=backend, **kwargs)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32))

    return [
        jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile().as_text()
        for fn in (fwd, jax.grad(loss, argnums=(0, 1, 2)))
    ]


def _assert_no_relayout(text, b, s, hq, hkv, d=128):
    """No transpose/copy producing Q/K/V/dO/out or their gradients, and no BHSD-shaped array at all."""
    for h in sorted({hq, hkv}):
        bhsd, bshd = rf"\[{b},{h},{s},{d}\]", rf"\[{b},{s},{h},{d}\]"
        assert not _hlo_lines(text, bhsd), _hlo_lines(text, bhsd)[:3]
        relayouts = _hlo_lines(text, rf"= bf16{bshd}\S* (copy|transpose|fusion)\(")
        assert not relayouts, relayouts[:3]


def test_bshd_call_has_no_transposes_around_the_kernel_and_inference_writes_no_lse():
    # The shape: S=4096, H=8, D=128 bf16 on a v6e, default options. Before: three
    # copy_bitcast_fusion transposes of Q, K, V to BHSD, one copy of the output back, and an f32
    # [B, H, S, 128] lse.
    fwd, grad = _compile_bshd("v6e", 1, 4096, 8, 8, causal=True)
    _assert_no_relayout(fwd, 1, 4096, 8, 8)
    _assert_no_relayout(grad, 1, 4096, 8, 8)
    kernel = _hlo_lines(fwd, r"custom-call\(.*flashport_flash_fwd|flashport_flash_fwd\S* = ")
    assert kernel and all("f32[" not in line.split("custom-call(")[0] for line in kernel), kernel
    # The gradient's forward writes the lse, compactly: [B, H, nq, 1, bq] rows, not [B, H, S, 128].
    fwd_in_grad = _hlo_lines(grad, r"%flashport_flash_fwd\S* = ")
    assert fwd_in_grad and re.search(r"f32\[1,8,\d+,1,\d+\]", fwd_in_grad[0]), fwd_in_grad
    assert "flashport_flash_dkv" in grad and "flashport_flash_dq" in grad


def test_bshd_gqa_call_has_no_transposes_around_the_kernels():
    # GQA 8/2 on a v5e at B = 2, S = 2048, default options: the token-major kernels read the
    # caller's Q [B, S, 8, D] and K/V [B, S, 2, D] and write out, dQ, dK, dV in BSHD.
    fwd, grad = _compile_bshd("v5e", 2, 2048, 8, 2, causal=True)
    _assert_no_relayout(fwd, 2, 2048, 8, 2)
    _assert_no_relayout(grad, 2, 2048, 8, 2)
    for name in ("flashport_flash_fwd", "flashport_flash_dkv", "flashport_flash_dq"):
        calls = _hlo_lines(grad, rf"%{name}\S* = ")
        assert calls and "[2,2048," in calls[0], (name, calls)


def test_bshd_call_with_read_bshd_off_transposes():
    # The opt-out keeps the heads-major kernels: their BHSD operands are transposes of the caller's.
    sharding = one_chip("v6e")
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16, sharding=sharding)
    backend = registry.use("pallas_tpu", read_bshd=False)
    text = (
        jax.jit(lambda q: flashport.attention(q, q, q, backend=backend))
        .trace(q)
        .lower(lowering_platforms=("tpu",))
        .compile()
        .as_text()
    )
    assert _hlo_lines(text, r"\[1,8,1024,128\]")
