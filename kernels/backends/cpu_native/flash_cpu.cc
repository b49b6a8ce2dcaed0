// FlashAttention-2 on CPU, float32, as two XLA FFI handlers (forward: out + lse; backward: dq, dk, dv).
//
// Arrays are canonical BHSD, row-major: q [.., Hq, Sq, D], k [.., Hkv, Sk, D], v [.., Hkv, Sk, Dv]
// (all leading dims fold into one batch; vmap adds one). Query head h reads kv head h / (Hq / Hkv).
// Logits are scale * q.k; key j is visible to query i when j < Sk and, with t = i + offset,
// (!causal || j <= t) && (left < 0 || j >= t - left) && (right < 0 || j <= t + right).
// lse is the natural log-sum-exp of the visible logits (-inf for a row that sees no key).
//
// Forward: one work item per (batch, head, query block), largest causal blocks first, taken by
// std::threads from an atomic counter. Per item: S = (scale Q) K^T against K^T packed once per call
// ([D, Sk] per kv head, so the micro-kernel vectorizes along keys), online softmax, O += P V.
// Backward: one work item per (batch, kv head, key block), visiting the query blocks (and the
// query heads of its group) that see it: S = (scale Q) K^T, P = exp(S - lse), dP = dO V^T,
// dS = P (dP - delta), dV += P^T dO, dK += dS^T Q, dQ += dS K into a per-thread dQ summed at the end.
// K^T and V^T are packed once per call in panels of 64 keys.
//
// The matmuls are one register-blocked FMA kernel (C (+)= op(A) B, op(A) = A or A^T); the exp is a
// Cephes-style polynomial (max relative error 1.2e-7 over [-87, 0] against double exp). AVX-512
// when the compiler targets it, else plain loops the compiler vectorizes as it can.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// C[m, n] (+)= A[m, kk] B[kk, n]; leading dimensions in elements.

#ifdef __AVX512F__
template <bool TA, int MR, int NV>
inline void tile(int kk, const float* a, long lda, const float* b, long ldb, float* c, long ldc,
                 __mmask16 last, bool acc) {
  // Accumulators start at zero and C is added at the end: a conditional start keeps GCC from
  // holding them in registers.
  __m512 r[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) r[i][v] = _mm512_setzero_ps();
  for (int p = 0; p < kk; ++p) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, b + p * ldb + 16 * v)
                          : _mm512_loadu_ps(b + p * ldb + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(TA ? a[p * lda + i] : a[i * lda + p]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) r[i][v] = _mm512_fmadd_ps(av, bv[v], r[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* ci = c + i * ldc + 16 * v;
      const __mmask16 mk = v == NV - 1 ? last : static_cast<__mmask16>(0xFFFF);
      __m512 x = r[i][v];
      if (acc) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mk, ci));
      _mm512_mask_storeu_ps(ci, mk, x);
    }
}

template <bool TA, int MR>
inline void tile_nv(int nv, int kk, const float* a, long lda, const float* b, long ldb, float* c,
                    long ldc, __mmask16 last, bool acc) {
  switch (nv) {
    case 1: tile<TA, MR, 1>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
    case 2: tile<TA, MR, 2>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
    case 3: tile<TA, MR, 3>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
    default: tile<TA, MR, 4>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
  }
}

// C[m, n] (+)= op(A) B. op(A)[i, p] = a[i * lda + p], or a[p * lda + i] when TA. B's columns come in
// panels of 64: element [p, j] is b[(j / 64) * bps + p * ldb + j % 64] (a row-major B: bps = 64).
#ifndef FLASH_KC
#define FLASH_KC 64
#endif
constexpr int KC = FLASH_KC;

template <bool TA>
void gemm(int m, int n, int kk, const float* a, long lda, const float* b, long ldb, long bps, float* c,
          long ldc, bool acc) {
  for (int j = 0; j < n; j += 64) {
    const int w = std::min(64, n - j);
    const int nv = (w + 15) / 16;
    const __mmask16 last = (w % 16) ? static_cast<__mmask16>((1u << (w % 16)) - 1) : 0xFFFF;
    // Chunks of the inner dimension keep B's [kc, 64] panel in L1 while the row blocks reuse it.
    for (int p0 = 0; p0 < kk; p0 += KC) {
      const int kc = std::min(KC, kk - p0);
      const bool accumulate = acc || p0 > 0;
      const float* bj = b + (j / 64) * bps + p0 * ldb;
      const float* a0 = a + (TA ? p0 * lda : p0);
      const long step = TA ? 1 : lda;
      int i = 0;
      for (; i + 6 <= m; i += 6)
        tile_nv<TA, 6>(nv, kc, a0 + i * step, lda, bj, ldb, c + i * ldc + j, ldc, last, accumulate);
      const float* ai = a0 + i * step;
      float* ci = c + i * ldc + j;
      switch (m - i) {
        case 5: tile_nv<TA, 5>(nv, kc, ai, lda, bj, ldb, ci, ldc, last, accumulate); break;
        case 4: tile_nv<TA, 4>(nv, kc, ai, lda, bj, ldb, ci, ldc, last, accumulate); break;
        case 3: tile_nv<TA, 3>(nv, kc, ai, lda, bj, ldb, ci, ldc, last, accumulate); break;
        case 2: tile_nv<TA, 2>(nv, kc, ai, lda, bj, ldb, ci, ldc, last, accumulate); break;
        case 1: tile_nv<TA, 1>(nv, kc, ai, lda, bj, ldb, ci, ldc, last, accumulate); break;
        default: break;
      }
    }
  }
}

inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << remaining) - 1);
}
#else
template <bool TA>
void gemm(int m, int n, int kk, const float* a, long lda, const float* b, long ldb, long bps, float* c,
          long ldc, bool acc) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (!acc) std::fill(ci, ci + n, 0.0f);
    for (int p = 0; p < kk; ++p) {
      const float av = TA ? a[p * lda + i] : a[i * lda + p];
      for (int j0 = 0; j0 < n; j0 += 64) {
        const float* bp = b + (j0 / 64) * bps + p * ldb - j0;
        for (int j = j0; j < std::min(n, j0 + 64); ++j) ci[j] += av * bp[j];
      }
    }
  }
}
#endif

constexpr long kPanel = 64;

// x[i] = exp(x[i] - shift); returns the sum.
inline float exp_shift_sum(float* x, int n, float shift) {
#ifdef __AVX512F__
  __m512 s = _mm512_set1_ps(shift), acc = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 mk = tail_mask(n - j);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, x + j), s));
    e = _mm512_maskz_mov_ps(mk, e);
    _mm512_mask_storeu_ps(x + j, mk, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.0f;
  for (int j = 0; j < n; ++j) acc += (x[j] = std::exp(x[j] - shift));
  return acc;
#endif
}

inline float row_max(const float* x, int n) {
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int j = 0; j < n; j += 16) {
    const __mmask16 mk = tail_mask(n - j);
    m = _mm512_mask_max_ps(m, mk, m, _mm512_maskz_loadu_ps(mk, x + j));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = kNegInf;
  for (int j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
#endif
}

inline void scale_row(float* x, int n, float f) {
  for (int j = 0; j < n; ++j) x[j] *= f;
}

// Over one row of n: p = exp(s - lse) in place of s; ds = p * (dp - delta) in place of dp.
inline void probs_and_dscores(float* s, float* dp, float lse, float delta, int n) {
#ifdef __AVX512F__
  const __m512 l = _mm512_set1_ps(lse), dl = _mm512_set1_ps(delta);
  for (int j = 0; j < n; j += 16) {
    const __mmask16 mk = tail_mask(n - j);
    __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), l));
    __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, dp + j), dl);
    _mm512_mask_storeu_ps(s + j, mk, p);
    _mm512_mask_storeu_ps(dp + j, mk, _mm512_mul_ps(p, d));
  }
#else
  for (int j = 0; j < n; ++j) {
    const float p = std::exp(s[j] - lse);
    s[j] = p;
    dp[j] = p * (dp[j] - delta);
  }
#endif
}

// ---------------------------------------------------------------------------------------------

struct Mask {
  long sq, sk, offset, left, right;
  bool causal;
  // Visible keys of query i: [lo(i), hi(i)), both nondecreasing in i.
  long lo(long i) const { return left < 0 ? 0 : std::max(0L, i + offset - left); }
  long hi(long i) const {
    long h = sk;
    if (causal) h = std::min(h, i + offset + 1);
    if (right >= 0) h = std::min(h, i + offset + right + 1);
    return std::max(h, 0L);
  }
};

int thread_count(int64_t requested) {
  if (requested > 0) return static_cast<int>(requested);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

// Runs fn(item, thread) for item in [0, n) on `threads` threads (the caller is thread 0).
template <typename F>
void parallel_for(long n, int threads, F&& fn) {
  threads = static_cast<int>(std::min<long>(threads, std::max(n, 1L)));
  std::atomic<long> next{0};
  auto worker = [&](int t) {
    for (long i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, t);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& th : pool) th.join();
}

// Packs a row-major [rows, cols] matrix (row stride ld) as its transpose in panels of kPanel rows:
// dst[(r / kPanel) * cols * kPanel + c * kPanel + r % kPanel] = src[r, c], the last panel zero-padded.
// As the B operand of gemm (ldb = kPanel, bps = cols * kPanel) it is the [cols, rows] matrix src^T.
void pack_transposed(const float* src, long rows, long cols, long ld, float* dst) {
  for (long r0 = 0; r0 < rows; r0 += kPanel) {
    float* panel = dst + (r0 / kPanel) * cols * kPanel;
    const long n = std::min(kPanel, rows - r0);
    for (long r = 0; r < kPanel; ++r)
      for (long c = 0; c < cols; ++c) panel[c * kPanel + r] = r < n ? src[(r0 + r) * ld + c] : 0.0f;
  }
}

long panels(long rows) { return (rows + kPanel - 1) / kPanel; }

long round_up(long x, long to) { return (x + to - 1) / to * to; }

struct Shapes {
  long batch, hq, hkv, sq, sk, d, dv;
};

ffi::Error shapes_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                     Shapes* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t r = qd.size();
  if (r < 3 || kd.size() != r || vd.size() != r)
    return ffi::Error::InvalidArgument("flash_cpu: q, k, v need the same rank >= 3");
  long bq = 1, bk = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    bq *= qd[i];
    bk *= kd[i];
  }
  if (bq != bk) return ffi::Error::InvalidArgument("flash_cpu: q and k batch dims differ");
  *s = {bq, qd[r - 3], kd[r - 3], qd[r - 2], kd[r - 2], qd[r - 1], vd[r - 1]};
  if (kd[r - 1] != s->d || vd[r - 2] != s->sk || vd[r - 3] != s->hkv || s->hkv == 0 || s->hq % s->hkv)
    return ffi::Error::InvalidArgument("flash_cpu: inconsistent q/k/v shapes");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, float scale, int64_t causal,
                   int64_t left, int64_t right, int64_t offset, int64_t block_q, int64_t block_k,
                   int64_t num_threads) {
  Shapes s;
  if (auto err = shapes_of(q, k, v, &s); err.failure()) return err;
  const Mask mask{s.sq, s.sk, offset, left, right, causal != 0};
  const long group = s.hq / s.hkv, bq_max = std::max<long>(1, block_q);
  const long bk_max = round_up(std::max<long>(1, block_k), kPanel);
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const int threads = thread_count(num_threads);

  // K^T per kv head, packed in key panels (pack_transposed).
  const long kt_size = panels(s.sk) * kPanel * s.d;
  std::vector<float> kt(static_cast<size_t>(s.batch * s.hkv * kt_size));
  parallel_for(s.batch * s.hkv, threads, [&](long bh, int) {
    pack_transposed(kp + bh * s.sk * s.d, s.sk, s.d, s.d, kt.data() + bh * kt_size);
  });

  const long nq = (s.sq + bq_max - 1) / bq_max, heads = s.batch * s.hq;
  struct Scratch {
    std::vector<float> qs, sc, acc, m, l;
  };
  std::vector<Scratch> scratch(threads);
  parallel_for(heads * nq, threads, [&](long item, int t) {
    Scratch& w = scratch[t];
    if (w.sc.empty()) {
      w.qs.resize(bq_max * s.d);
      w.sc.resize(bq_max * bk_max);
      w.acc.resize(bq_max * s.dv);
      w.m.resize(bq_max);
      w.l.resize(bq_max);
    }
    const long blk = nq - 1 - item / heads, bh = item % heads;  // the longest (causal) rows first
    const long b = bh / s.hq, h = bh % s.hq, bkv = b * s.hkv + h / group;
    const long i0 = blk * bq_max, rows = std::min(bq_max, s.sq - i0);
    const float* qb = qp + (bh * s.sq + i0) * s.d;
    for (long r = 0; r < rows * s.d; ++r) w.qs[r] = qb[r] * scale;
    std::fill(w.acc.begin(), w.acc.begin() + rows * s.dv, 0.0f);
    std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
    std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
    const long jlo = mask.lo(i0) / kPanel * kPanel, jhi = mask.hi(i0 + rows - 1);
    const float* ktb = kt.data() + bkv * kt_size;
    const float* vb = vp + bkv * s.sk * s.dv;
    for (long j0 = jlo; j0 < jhi; j0 += bk_max) {
      const long cols = std::min(bk_max, jhi - j0);
      float* sc = w.sc.data();
      gemm<false>(rows, cols, s.d, w.qs.data(), s.d, ktb + j0 * s.d, kPanel, s.d * kPanel, sc, bk_max, false);
      const bool full = mask.lo(i0 + rows - 1) <= j0 && mask.hi(i0) >= j0 + cols;
      for (long r = 0; r < rows; ++r) {
        float* row = sc + r * bk_max;
        if (!full) {
          const long a = std::clamp(mask.lo(i0 + r) - j0, 0L, cols), e = std::clamp(mask.hi(i0 + r) - j0, 0L, cols);
          std::fill(row, row + std::min(a, e), kNegInf);
          std::fill(row + std::max(a, e), row + cols, kNegInf);
        }
        const float m_new = std::max(w.m[r], row_max(row, cols));
        if (m_new == kNegInf) {  // no key visible yet: p = 0, nothing to rescale
          std::fill(row, row + cols, 0.0f);
          continue;
        }
        const float alpha = std::exp(w.m[r] - m_new);
        const float sum = exp_shift_sum(row, cols, m_new);
        if (alpha != 1.0f) scale_row(w.acc.data() + r * s.dv, s.dv, alpha);
        w.l[r] = w.l[r] * alpha + sum;
        w.m[r] = m_new;
      }
      gemm<false>(rows, s.dv, cols, sc, bk_max, vb + j0 * s.dv, s.dv, kPanel, w.acc.data(), s.dv, true);
    }
    float* ob = op + (bh * s.sq + i0) * s.dv;
    float* lb = lp + bh * s.sq + i0;
    for (long r = 0; r < rows; ++r) {
      const float l = w.l[r];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (long c = 0; c < s.dv; ++c) ob[r * s.dv + c] = w.acc[r * s.dv + c] * inv;
      lb[r] = l > 0.0f ? w.m[r] + std::log(l) : kNegInf;
    }
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_o,
                    ffi::Buffer<ffi::F32> d_lse, ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv, float scale, int64_t causal, int64_t left, int64_t right,
                    int64_t offset, int64_t block_q, int64_t block_k, int64_t num_threads) {
  Shapes s;
  if (auto err = shapes_of(q, k, v, &s); err.failure()) return err;
  const Mask mask{s.sq, s.sk, offset, left, right, causal != 0};
  const long group = s.hq / s.hkv, bq_max = std::max<long>(1, block_q);
  const long bk_max = round_up(std::max<long>(1, block_k), kPanel);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = o.typed_data();
  const float *lp = lse.typed_data(), *dop = d_o.typed_data(), *dlp = d_lse.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  const int threads = thread_count(num_threads);
  const long heads = s.batch * s.hq, kv_heads = s.batch * s.hkv;

  // Per kv head: K^T and V^T packed in key panels. Per query head: delta = rowsum(dO O) - dlse, and
  // lse with -inf (rows that see no key) as +inf so that their probabilities come out 0.
  const long kt_size = panels(s.sk) * kPanel * s.d, vt_size = panels(s.sk) * kPanel * s.dv;
  std::vector<float> kt(kv_heads * kt_size), vt(kv_heads * vt_size);
  std::vector<float> delta(heads * s.sq), lse_safe(heads * s.sq);
  parallel_for(heads + kv_heads, threads, [&](long item, int) {
    if (item >= heads) {
      const long bh = item - heads;
      pack_transposed(kp + bh * s.sk * s.d, s.sk, s.d, s.d, kt.data() + bh * kt_size);
      pack_transposed(vp + bh * s.sk * s.dv, s.sk, s.dv, s.dv, vt.data() + bh * vt_size);
      return;
    }
    const long bh = item;
    for (long i = 0; i < s.sq; ++i) {
      const float* a = dop + (bh * s.sq + i) * s.dv;
      const float* b = op + (bh * s.sq + i) * s.dv;
      float acc = 0.0f;
      for (long c = 0; c < s.dv; ++c) acc += a[c] * b[c];
      delta[bh * s.sq + i] = acc - dlp[bh * s.sq + i];
      const float l = lp[bh * s.sq + i];
      lse_safe[bh * s.sq + i] = l == kNegInf ? std::numeric_limits<float>::infinity() : l;
    }
  });

  const long nk = (s.sk + bk_max - 1) / bk_max;
  const int used = static_cast<int>(std::min<long>(threads, std::max(kv_heads * nk, 1L)));
  std::vector<std::vector<float>> dq_part(used);  // per thread dQ [heads, sq, d] (unscaled)
  struct Scratch {
    std::vector<float> qs, p, ds, dk, dv;
  };
  std::vector<Scratch> scratch(used);
  parallel_for(kv_heads * nk, used, [&](long item, int t) {
    Scratch& w = scratch[t];
    if (w.p.empty()) {
      w.qs.resize(bq_max * s.d);
      w.p.resize(bq_max * bk_max);
      w.ds.resize(bq_max * bk_max);
      w.dk.resize(bk_max * s.d);
      w.dv.resize(bk_max * s.dv);
      dq_part[t].assign(heads * s.sq * s.d, 0.0f);
    }
    const long blk = item / kv_heads, bkv = item % kv_heads;  // the key blocks most rows see first
    const long b = bkv / s.hkv, hk = bkv % s.hkv;
    const long j0 = blk * bk_max, cols = std::min(bk_max, s.sk - j0);
    const float* kb = kp + (bkv * s.sk + j0) * s.d;
    const float* ktb = kt.data() + bkv * kt_size + j0 * s.d;
    const float* vtb = vt.data() + bkv * vt_size + j0 * s.dv;
    std::fill(w.dk.begin(), w.dk.begin() + cols * s.d, 0.0f);
    std::fill(w.dv.begin(), w.dv.begin() + cols * s.dv, 0.0f);
    // Query rows that see a key of [j0, j0 + cols): hi(i) > j0 and lo(i) < j0 + cols (monotone in i).
    long a = 0, z = s.sq;
    while (a < z) {
      const long mid = (a + z) / 2;
      if (mask.hi(mid) > j0) z = mid; else a = mid + 1;
    }
    const long ilo = a;
    z = s.sq;
    while (a < z) {
      const long mid = (a + z) / 2;
      if (mask.lo(mid) < j0 + cols) a = mid + 1; else z = mid;
    }
    const long ihi = a;
    for (long g = 0; g < group; ++g) {
      const long bh = b * s.hq + hk * group + g;
      float* dqb = dq_part[t].data() + bh * s.sq * s.d;
      for (long i0 = ilo; i0 < ihi; i0 += bq_max) {
        const long rows = std::min(bq_max, ihi - i0);
        const float* qb = qp + (bh * s.sq + i0) * s.d;
        const float* dob = dop + (bh * s.sq + i0) * s.dv;
        for (long r = 0; r < rows * s.d; ++r) w.qs[r] = qb[r] * scale;
        float *p = w.p.data(), *ds = w.ds.data();
        gemm<false>(rows, cols, s.d, w.qs.data(), s.d, ktb, kPanel, s.d * kPanel, p, bk_max, false);
        gemm<false>(rows, cols, s.dv, dob, s.dv, vtb, kPanel, s.dv * kPanel, ds, bk_max, false);
        const bool full = mask.lo(i0 + rows - 1) <= j0 && mask.hi(i0) >= j0 + cols;
        for (long r = 0; r < rows; ++r) {
          float* row = p + r * bk_max;
          if (!full) {
            const long lo = std::clamp(mask.lo(i0 + r) - j0, 0L, cols), hi = std::clamp(mask.hi(i0 + r) - j0, 0L, cols);
            std::fill(row, row + std::min(lo, hi), kNegInf);
            std::fill(row + std::max(lo, hi), row + cols, kNegInf);
          }
          probs_and_dscores(row, ds + r * bk_max, lse_safe[bh * s.sq + i0 + r], delta[bh * s.sq + i0 + r],
                            static_cast<int>(cols));
        }
        gemm<true>(cols, s.dv, rows, p, bk_max, dob, s.dv, kPanel, w.dv.data(), s.dv, true);
        gemm<true>(cols, s.d, rows, ds, bk_max, qb, s.d, kPanel, w.dk.data(), s.d, true);
        gemm<false>(rows, s.d, cols, ds, bk_max, kb, s.d, kPanel, dqb + i0 * s.d, s.d, true);
      }
    }
    float* dkb = dkp + (bkv * s.sk + j0) * s.d;
    float* dvb = dvp + (bkv * s.sk + j0) * s.dv;
    for (long x = 0; x < cols * s.d; ++x) dkb[x] = w.dk[x] * scale;
    std::copy(w.dv.begin(), w.dv.begin() + cols * s.dv, dvb);
  });
  parallel_for(heads, threads, [&](long bh, int) {
    float* dqb = dqp + bh * s.sq * s.d;
    std::fill(dqb, dqb + s.sq * s.d, 0.0f);
    for (auto& part : dq_part) {
      if (part.empty()) continue;
      const float* src = part.data() + bh * s.sq * s.d;
      for (long x = 0; x < s.sq * s.d; ++x) dqb[x] += scale * src[x];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashportCpuForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashportCpuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("num_threads"));
