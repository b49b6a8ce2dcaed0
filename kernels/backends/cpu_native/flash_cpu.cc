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
// query heads of its group) that see it, in the transposed orientation: S^T = K (scale Q)^T,
// P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q,
// dQ^T += K^T dS^T into a per-thread [D, Sq] buffer summed at the end.
//
// The matmuls are one register-blocked FMA kernel (C (+)= A B, A and B row-major); the exp is a
// Cephes-style polynomial (max relative error ~2e-7). AVX-512 when the compiler targets it, else
// plain loops the compiler vectorizes as it can.

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
template <int MR, int NV>
inline void tile(int kk, const float* a, long lda, const float* b, long ldb, float* c, long ldc,
                 __mmask16 last, bool acc) {
  __m512 r[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v)
      r[i][v] = acc ? (v == NV - 1 ? _mm512_maskz_loadu_ps(last, c + i * ldc + 16 * v)
                                   : _mm512_loadu_ps(c + i * ldc + 16 * v))
                    : _mm512_setzero_ps();
  for (int p = 0; p < kk; ++p) {
    __m512 bv[NV];
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, b + p * ldb + 16 * v)
                          : _mm512_loadu_ps(b + p * ldb + 16 * v);
    for (int i = 0; i < MR; ++i) {
      __m512 av = _mm512_set1_ps(a[i * lda + p]);
      for (int v = 0; v < NV; ++v) r[i][v] = _mm512_fmadd_ps(av, bv[v], r[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      if (v == NV - 1)
        _mm512_mask_storeu_ps(c + i * ldc + 16 * v, last, r[i][v]);
      else
        _mm512_storeu_ps(c + i * ldc + 16 * v, r[i][v]);
    }
}

template <int MR>
inline void tile_nv(int nv, int kk, const float* a, long lda, const float* b, long ldb, float* c,
                    long ldc, __mmask16 last, bool acc) {
  switch (nv) {
    case 1: tile<MR, 1>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
    case 2: tile<MR, 2>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
    case 3: tile<MR, 3>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
    default: tile<MR, 4>(kk, a, lda, b, ldb, c, ldc, last, acc); break;
  }
}

void gemm(int m, int n, int kk, const float* a, long lda, const float* b, long ldb, float* c, long ldc,
          bool acc) {
  for (int j = 0; j < n; j += 64) {
    const int w = std::min(64, n - j);
    const int nv = (w + 15) / 16;
    const __mmask16 last = (w % 16) ? static_cast<__mmask16>((1u << (w % 16)) - 1) : 0xFFFF;
    int i = 0;
    for (; i + 6 <= m; i += 6) tile_nv<6>(nv, kk, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, last, acc);
    const float* ai = a + i * lda;
    float* ci = c + i * ldc + j;
    switch (m - i) {
      case 5: tile_nv<5>(nv, kk, ai, lda, b + j, ldb, ci, ldc, last, acc); break;
      case 4: tile_nv<4>(nv, kk, ai, lda, b + j, ldb, ci, ldc, last, acc); break;
      case 3: tile_nv<3>(nv, kk, ai, lda, b + j, ldb, ci, ldc, last, acc); break;
      case 2: tile_nv<2>(nv, kk, ai, lda, b + j, ldb, ci, ldc, last, acc); break;
      case 1: tile_nv<1>(nv, kk, ai, lda, b + j, ldb, ci, ldc, last, acc); break;
      default: break;
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
void gemm(int m, int n, int kk, const float* a, long lda, const float* b, long ldb, float* c, long ldc,
          bool acc) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (!acc) std::fill(ci, ci + n, 0.0f);
    for (int p = 0; p < kk; ++p) {
      const float av = a[i * lda + p];
      const float* bp = b + p * ldb;
      for (int j = 0; j < n; ++j) ci[j] += av * bp[j];
    }
  }
}
#endif

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

// p[r, c] = exp(s[r, c] - lse[c]); ds[r, c] = p[r, c] * (dp[r, c] - delta[c]), rows of length n.
inline void probs_and_dscores(float* s, float* dp, const float* lse, const float* delta, int n) {
#ifdef __AVX512F__
  for (int j = 0; j < n; j += 16) {
    const __mmask16 mk = tail_mask(n - j);
    __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), _mm512_maskz_loadu_ps(mk, lse + j)));
    __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, dp + j), _mm512_maskz_loadu_ps(mk, delta + j));
    _mm512_mask_storeu_ps(s + j, mk, p);
    _mm512_mask_storeu_ps(dp + j, mk, _mm512_mul_ps(p, d));
  }
#else
  for (int j = 0; j < n; ++j) {
    const float p = std::exp(s[j] - lse[j]);
    s[j] = p;
    dp[j] = p * (dp[j] - delta[j]);
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

// dst[c, r] = f * src[r, c] for a [rows, cols] matrix with row stride ld_src; dst row stride ld_dst.
void transpose(const float* src, long rows, long cols, long ld_src, float* dst, long ld_dst, float f) {
  constexpr long kB = 16;
  for (long r0 = 0; r0 < rows; r0 += kB)
    for (long c0 = 0; c0 < cols; c0 += kB)
      for (long r = r0; r < std::min(rows, r0 + kB); ++r)
        for (long c = c0; c < std::min(cols, c0 + kB); ++c) dst[c * ld_dst + r] = f * src[r * ld_src + c];
}

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
  const long group = s.hq / s.hkv, bq_max = std::max<long>(1, block_q), bk_max = std::max<long>(1, block_k);
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const int threads = thread_count(num_threads);

  // K^T per kv head: [batch * hkv, d, sk].
  std::vector<float> kt(static_cast<size_t>(s.batch * s.hkv * s.d * s.sk));
  parallel_for(s.batch * s.hkv, threads, [&](long bh, int) {
    transpose(kp + bh * s.sk * s.d, s.sk, s.d, s.d, kt.data() + bh * s.d * s.sk, s.sk, 1.0f);
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
    const long jlo = mask.lo(i0), jhi = mask.hi(i0 + rows - 1);
    const float* ktb = kt.data() + bkv * s.d * s.sk;
    const float* vb = vp + bkv * s.sk * s.dv;
    for (long j0 = jlo; j0 < jhi; j0 += bk_max) {
      const long cols = std::min(bk_max, jhi - j0);
      float* sc = w.sc.data();
      gemm(rows, cols, s.d, w.qs.data(), s.d, ktb + j0, s.sk, sc, bk_max, false);
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
      gemm(rows, s.dv, cols, sc, bk_max, vb + j0 * s.dv, s.dv, w.acc.data(), s.dv, true);
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
  const long group = s.hq / s.hkv, bq_max = std::max<long>(1, block_q), bk_max = std::max<long>(1, block_k);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = o.typed_data();
  const float *lp = lse.typed_data(), *dop = d_o.typed_data(), *dlp = d_lse.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  const int threads = thread_count(num_threads);
  const long heads = s.batch * s.hq, kv_heads = s.batch * s.hkv;

  // Packed per query head: (scale Q)^T and dO^T [d, sq]; delta = rowsum(dO O) - dlse and lse with
  // -inf (rows that see no key) as +inf so their probabilities come out 0. Per kv head: K^T.
  std::vector<float> qt(heads * s.d * s.sq), dot(heads * s.dv * s.sq), kt(kv_heads * s.d * s.sk);
  std::vector<float> delta(heads * s.sq), lse_safe(heads * s.sq);
  parallel_for(heads + kv_heads, threads, [&](long item, int) {
    if (item >= heads) {
      const long bh = item - heads;
      transpose(kp + bh * s.sk * s.d, s.sk, s.d, s.d, kt.data() + bh * s.d * s.sk, s.sk, 1.0f);
      return;
    }
    const long bh = item;
    transpose(qp + bh * s.sq * s.d, s.sq, s.d, s.d, qt.data() + bh * s.d * s.sq, s.sq, scale);
    transpose(dop + bh * s.sq * s.dv, s.sq, s.dv, s.dv, dot.data() + bh * s.dv * s.sq, s.sq, 1.0f);
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
  std::vector<std::vector<float>> dqt(used);  // per thread dQ^T [heads, d, sq], allocated on first use
  struct Scratch {
    std::vector<float> st, dpt, dk, dv;
  };
  std::vector<Scratch> scratch(used);
  parallel_for(kv_heads * nk, used, [&](long item, int t) {
    Scratch& w = scratch[t];
    if (w.st.empty()) {
      w.st.resize(bk_max * bq_max);
      w.dpt.resize(bk_max * bq_max);
      w.dk.resize(bk_max * s.d);
      w.dv.resize(bk_max * s.dv);
      dqt[t].assign(heads * s.d * s.sq, 0.0f);
    }
    const long blk = item / kv_heads, bkv = item % kv_heads;  // the key blocks most rows see first
    const long b = bkv / s.hkv, hk = bkv % s.hkv;
    const long j0 = blk * bk_max, cols = std::min(bk_max, s.sk - j0);
    const float* kb = kp + (bkv * s.sk + j0) * s.d;
    const float* vb = vp + (bkv * s.sk + j0) * s.dv;
    const float* ktb = kt.data() + bkv * s.d * s.sk + j0;
    std::fill(w.dk.begin(), w.dk.begin() + cols * s.d, 0.0f);
    std::fill(w.dv.begin(), w.dv.begin() + cols * s.dv, 0.0f);
    // Query rows that see a key of [j0, j0 + cols): hi(i) > j0 and lo(i) < j0 + cols (monotone in i).
    long ilo = 0, ihi = s.sq;
    {
      long a = 0, z = s.sq;
      while (a < z) {
        const long mid = (a + z) / 2;
        if (mask.hi(mid) > j0) z = mid; else a = mid + 1;
      }
      ilo = a;
      a = ilo, z = s.sq;
      while (a < z) {
        const long mid = (a + z) / 2;
        if (mask.lo(mid) < j0 + cols) a = mid + 1; else z = mid;
      }
      ihi = a;
    }
    for (long g = 0; g < group; ++g) {
      const long bh = b * s.hq + hk * group + g;
      const float* qtb = qt.data() + bh * s.d * s.sq;
      const float* dotb = dot.data() + bh * s.dv * s.sq;
      float* dqtb = dqt[t].data() + bh * s.d * s.sq;
      for (long i0 = ilo; i0 < ihi; i0 += bq_max) {
        const long rows = std::min(bq_max, ihi - i0);
        float *st = w.st.data(), *dpt = w.dpt.data();
        gemm(cols, rows, s.d, kb, s.d, qtb + i0, s.sq, st, bq_max, false);
        gemm(cols, rows, s.dv, vb, s.dv, dotb + i0, s.sq, dpt, bq_max, false);
        const bool full = mask.lo(i0 + rows - 1) <= j0 && mask.hi(i0) >= j0 + cols;
        if (!full) {
          for (long c = 0; c < cols; ++c)
            for (long r = 0; r < rows; ++r)
              if (j0 + c < mask.lo(i0 + r) || j0 + c >= mask.hi(i0 + r)) st[c * bq_max + r] = kNegInf;
        }
        for (long c = 0; c < cols; ++c)
          probs_and_dscores(st + c * bq_max, dpt + c * bq_max, lse_safe.data() + bh * s.sq + i0,
                            delta.data() + bh * s.sq + i0, static_cast<int>(rows));
        gemm(cols, s.dv, rows, st, bq_max, dop + (bh * s.sq + i0) * s.dv, s.dv, w.dv.data(), s.dv, true);
        gemm(cols, s.d, rows, dpt, bq_max, qp + (bh * s.sq + i0) * s.d, s.d, w.dk.data(), s.d, true);
        gemm(s.d, rows, cols, ktb, s.sk, dpt, bq_max, dqtb + i0, s.sq, true);
      }
    }
    float* dkb = dkp + (bkv * s.sk + j0) * s.d;
    float* dvb = dvp + (bkv * s.sk + j0) * s.dv;
    for (long x = 0; x < cols * s.d; ++x) dkb[x] = w.dk[x] * scale;
    std::copy(w.dv.begin(), w.dv.begin() + cols * s.dv, dvb);
  });
  // Key blocks past the last item (none) and kv heads no item touched keep zero gradients.
  if (kv_heads * nk == 0) {
    std::fill(dkp, dkp + kv_heads * s.sk * s.d, 0.0f);
    std::fill(dvp, dvp + kv_heads * s.sk * s.dv, 0.0f);
  }
  parallel_for(heads, threads, [&](long bh, int) {
    float* dqb = dqp + bh * s.sq * s.d;
    std::fill(dqb, dqb + s.sq * s.d, 0.0f);
    for (auto& part : dqt) {
      if (part.empty()) continue;
      const float* src = part.data() + bh * s.d * s.sq;
      for (long c = 0; c < s.d; ++c)
        for (long i = 0; i < s.sq; ++i) dqb[i * s.d + c] += scale * src[c * s.sq + i];
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
