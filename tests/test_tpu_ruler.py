"""The VLIW-bundle cycle ruler (``benchmarks/tpu_ruler.py``): its schedule arithmetic on a hand-written
schedule, and, with libtpu (``tpu_compile``), its agreement with libtpu's own estimate where that is
valid, its scaling with the grid, the MXU floor, and flashport's ratio to splash on one small config.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULER = ROOT / "benchmarks" / "tpu_ruler.py"
# Rows derived from a shorter sequence's schedules vs a direct compile: v6e S=8192 causal fwd from
# S=2048 measured flashport BHSD and BSHD exact, splash 0.32% above (1,276,260 vs 1,272,160).
DERIVED_TOLERANCE = 0.005


def _ruler():
    spec = importlib.util.spec_from_file_location("tpu_ruler", RULER)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tpu_ruler", module)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


# A grid loop of 10 trips holding a first-step region (vector stores, predicate "index != 0") and a
# tile body (MXU ops, predicate on a value loaded from a prefetched table).
SCHEDULE = """\
  0x0   :  { %s1_s1 = smov 0 } /* Start region 1 */
  0x1 LB: > { %s2_s2 = sphi %s1_s1, %s9_s9 /* iteration index */ } /* Start region 2 */
  0x2   : > { %p3_p3 = scmp.ne.s32.totalorder %s2_s2, 0 }
  0x3   : > { %4 = sbr.rel (%p3_p3) target = $region3 }
  0x4   : > { %20 = vst [vmem:[#allocation2] sm:$0xff] %v0_v0 }
  0x5   : > { %21 = vst [vmem:[#allocation2 + $0x8] sm:$0xff] %v0_v0 }
  0x6 PF: > { %s5_s5 = smov 1 } /* Start/End empty region 3 */
  0x7   : > { %s6_s6 = sld [smem:[#allocation7 + %s2_s2]] }
  0x8   : > { %p7_p7 = scmp.ge.s32.totalorder %s2_s2, %s6_s6 }
  0x9   : > { %8 = sbr.rel (%p7_p7) target = $region4 }
  0xa   : > { %v30_v1 = vmatmul.mubr.bf16.gmra.mxu0 %v1_v1 }
  0xb   : > { %v31_v2 = vmatmul.mubr.bf16.gmra.mxu0 %v2_v2 }
  0xc   : > { %v32_v3 = vpop.f32.mrf.mxu0 }
  0xd   : > { %v33_v4 = vpop.f32.mrf.mxu0 }
  0xe PF: > { %s10_s10 = smov 2 } /* Start/End empty region 4 */
  0xf   : > { %s9_s9 = sadd.s32 1, %s2_s2 }
  0x10  : > { %p11_p11 = scmp.ge.s32.totalorder %s9_s9, 10 /* loop exit test */ }
  0x11  :  { %12 = sbr.rel (!%p11_p11) target = $region2 }
  0x12  :  { %13 = shalt }
"""


def test_schedule_arithmetic_counts_each_region_by_how_often_it_runs():
    ruler = _ruler()
    sched = ruler.parse(SCHEDULE)
    breakdown = ruler.measure(sched, ruler.Counts(rows=3, full=0, partial=7))
    # 2 bundles outside the loop; 11 loop bundles outside its regions x 10 trips; the first-step
    # region (2 bundles) once per row; the tile body (4 bundles) once per computed tile.
    assert breakdown.grid_trips == 10
    assert breakdown.tile_bundles == [4]
    assert sorted(breakdown.regions) == [("edge", 2, 3), ("tile", 4, 7)]
    assert breakdown.cycles == 2 + 11 * 10 + 2 * 3 + 4 * 7


def test_grid_trips_of_another_length_rescale_only_the_per_step_bundles():
    ruler = _ruler()
    # The same schedule counted for a grid of 18 steps (+2 pipeline trips) with 5 rows and 30 tiles.
    breakdown = ruler.measure(ruler.parse(SCHEDULE), ruler.Counts(rows=5, full=0, partial=30), grid_trips=20)
    assert breakdown.grid_trips == 20
    assert breakdown.cycles == 2 + 11 * 20 + 2 * 5 + 4 * 30


def test_two_tile_bodies_split_the_tiles_by_class():
    ruler = _ruler()
    # The same loop with a second, longer (masked) tile body after the first.
    masked = SCHEDULE.replace(
        "  0xe PF: > { %s10_s10 = smov 2 } /* Start/End empty region 4 */\n",
        "  0xe PF: > { %s10_s10 = smov 2 } /* Start/End empty region 4 */\n"
        "  0xe   : > { %14 = sbr.rel (%p7_p7) target = $region5 }\n"
        + "".join(f"  0xe   : > {{ %v{40 + n}_v5 = vmatmul.mubr.bf16.gmra.mxu1 %v5_v5 }}\n" for n in range(6))
        + "  0xe PF: > { %s15_s15 = smov 3 } /* Start/End empty region 5 */\n",
    )
    breakdown = ruler.measure(ruler.parse(masked), ruler.Counts(rows=3, full=5, partial=2))
    assert breakdown.tile_bundles == [4, 6]
    assert ("tile", 4, 5) in breakdown.regions and ("tile", 6, 2) in breakdown.regions


def test_tile_classes_match_a_dense_mask():
    np = pytest.importorskip("numpy")
    ruler = _ruler()
    for mask in ("full", "causal", "window", "segments"):
        cfg = ruler.Config("v6e", 1024, 128, mask, False, window=300, segments=3)
        q = np.arange(cfg.seq)[:, None]
        k = np.arange(cfg.seq)[None, :]
        vis = np.ones((cfg.seq, cfg.seq), bool)
        if cfg.causal:
            vis &= k <= q
        if mask == "window":
            vis &= q - k <= cfg.window
        if mask == "segments":
            vis &= q * 3 // cfg.seq == k * 3 // cfg.seq
        assert ruler.visible_pairs(cfg) == vis.sum()
        tiles = vis.reshape(8, 128, 4, 256).transpose(0, 2, 1, 3).reshape(8, 4, -1)
        full, partial = int(tiles.all(-1).sum()), int((tiles.any(-1) & ~tiles.all(-1)).sum())
        assert ruler.tile_classes(cfg, 128, 256, skip_segments=True, full_segments=True) == (full, partial)


@pytest.fixture(scope="module")
def validation():
    """``tpu_ruler.validation()`` run in its own process (libtpu must see the dump flags first)."""
    pytest.importorskip("libtpu", reason='needs libtpu: pip install "jax[tpu]==<installed jax version>"')
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    run = subprocess.run(
        [sys.executable, str(RULER), "--validate", "--gens", "v6e"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=3600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.tpu_compile
def test_mxu_rate_is_the_vendor_peak_over_the_clock(validation):
    # v6e: 918 TFLOP/s bf16 at about 1.75 GHz.
    assert validation["rate"] == pytest.approx(918e12 / 1.75e9, rel=0.02)


@pytest.mark.tpu_compile
def test_ruler_matches_libtpu_where_its_estimate_is_valid(validation):
    # JAX's flash_attention without a mask runs every tile; libtpu's static estimate counts it exactly.
    row = validation["jax_flash"]["full"]
    assert row["ruler"] == pytest.approx(row["libtpu"], rel=0.05)


@pytest.mark.tpu_compile
def test_ruler_counts_causal_skipping_that_libtpu_over_counts(validation):
    # Causal: libtpu counts a grid condition it cannot bound as taken, so its estimate is an upper
    # bound; the ruler counts the tiles the mask leaves (10 of 16 per head at S = 2048, 512 blocks).
    full, causal = validation["jax_flash"]["full"], validation["jax_flash"]["causal"]
    assert causal["ruler"] <= causal["libtpu"]
    assert causal["ruler"] / full["ruler"] == pytest.approx(10 / 16, abs=0.1)


@pytest.mark.tpu_compile
def test_ruler_scales_with_the_grid(validation):
    small, large = validation["grid"]["2048"], validation["grid"]["4096"]
    assert large["tiles"] == 4 * small["tiles"]
    assert large["cycles"] / small["cycles"] == pytest.approx(4.0, rel=0.1)


@pytest.mark.tpu_compile
def test_no_estimate_falls_below_the_mxu_floor(validation):
    for row in validation["rows"]:
        assert row["ceiling"] >= row["floor"] > 0
        for kernel in ("splash", "BHSD", "BSHD"):
            assert row[kernel] >= row["floor"], (row["config"], kernel)


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    "config,bound",
    # fwd: 0.76 (BHSD, head blocks; 0.86 before) and 0.82 (BSHD); bwd: 0.95 (BSHD) with key-major
    # dK/dV tiles (0.99 before), BHSD below it.
    [("v6e S=2048 D=128 full fwd", 0.9), ("v6e S=2048 D=128 full bwd", 0.97)],
)
def test_flashport_is_not_slower_than_splash_on_the_ruler(validation, config, bound):
    (row,) = [r for r in validation["rows"] if r["config"] == config]
    for layout in ("BHSD", "BSHD"):
        assert row[layout] / row["splash"] <= bound, (layout, row)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("kernel", ["splash", "BHSD"])
def test_rows_derived_from_a_shorter_sequence_match_a_direct_compile(validation, kernel):
    # The tile bodies and step code compiled at S=2048 are those of S=8192 (same blocks): counted
    # with S=8192's tiles, rows and grid trips they give the directly compiled row's cycles.
    row = validation["derived"][kernel]
    assert row["derived"] == pytest.approx(row["direct"], rel=DERIVED_TOLERANCE)


@pytest.mark.tpu_compile
def test_mxu_rates_are_read_per_chip():
    # One process, two chips: the same matmul program lowers to the same text for both, so the
    # schedules must be kept per chip (v5e's 4 MXUs of 128x128 against v6e's 256x256 arrays).
    pytest.importorskip("libtpu", reason='needs libtpu: pip install "jax[tpu]==<installed jax version>"')
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import tpu_ruler as r; r.enable();"
        "print(json.dumps([r.mxu_rate('v5e'), r.mxu_rate('v6e')]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    v5e, v6e = json.loads(run.stdout.strip().splitlines()[-1])
    assert v6e == pytest.approx(918e12 / 1.75e9, rel=0.02)
    assert v6e / v5e > 3
