// Attention of a few new positions over a KV cache, each position computed on its own and the same
// way whatever else the call holds: the exact attention of the kquant runner (`kquant.cpp`, used by
// `Transformer._attend_rows` and the C++ decoder stack alike).
//
// Why not `scaled_dot_product_attention`: to keep a position's bits independent of the call, the runner
// called it once per position and layer, and each call read the layer's whole cache again, so verifying
// n positions cost n times the attention of a decode step, which at long contexts is a large part of the
// step (BENCHMARKS.md, "What made kquant fast"). Here one parallel call per layer takes every new
// position, a task per (KV head, run of consecutive positions): each block of key and value rows is read
// once for the positions of the run and the query heads that share it (grouped-query attention: 6 in
// Qwen2.5-1.5B), where reading it again per position and head had made verification at long contexts
// cost far more than its arithmetic (BENCHMARKS.md, "AVX-512 (Zen 5)").
//
// Exactness: for each (position, head) the arithmetic is a fixed sequence that depends only on the
// position's visible slots: a dot product per slot (16-lane fused multiply-adds over the head dimension,
// then one fixed reduction), e^x by Cody–Waite reduction and a polynomial, the softmax sum in a fixed
// order for the number of slots, and the weighted values accumulated in slot order. So a position gets
// the same bits alone, in a chain of verification or as a node of a token tree whose visible slots are
// the same; and the portable code performs the same operations, so every CPU gets those bits.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#define EXACT_ATTENTION_AVX512 1
#else
#define EXACT_ATTENTION_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define EXACT_ATTENTION_AVX2 1
#else
#define EXACT_ATTENTION_AVX2 0
#endif
#if EXACT_ATTENTION_AVX512 || EXACT_ATTENTION_AVX2
#include <immintrin.h>
#endif

namespace exact_attention {

// e^x for x ≤ 0 (a score minus the row's largest): x = n·ln 2 + r, e^r by a degree-7 polynomial (Cephes'
// expf), times 2^n. Below −80 the result is e^−80, negligible beside the largest term (1).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f, kFloor = -80.0f;
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_portable(float x) {
  x = std::max(x, kFloor);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kPoly[i]);
  float y = std::fma(p, r * r, r) + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  bits += int32_t(n) << 23;
  std::memcpy(&y, &bits, 4);
  return y;
}

#if EXACT_ATTENTION_AVX512
inline __m512 exp16(__m512 x) {  // the same operations as `exp_portable`, on 16 lanes
  x = _mm512_max_ps(x, _mm512_set1_ps(kFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}
#endif

#if EXACT_ATTENTION_AVX2
inline __m256 exp8(__m256 x) {  // the same operations as `exp_portable`, on 8 lanes
  x = _mm256_max_ps(x, _mm256_set1_ps(kFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}
#endif

// The sum of 16 partial sums, halves added pairwise: (a[l] + a[l+8]), then (+4), (+2), (+1).
inline float reduce16(const float* a) {
  float b[8], c[4], d[2];
  for (int l = 0; l < 8; ++l) b[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) c[l] = b[l] + b[l + 4];
  for (int l = 0; l < 2; ++l) d[l] = c[l] + c[l + 2];
  return d[0] + d[1];
}

#if EXACT_ATTENTION_AVX512
inline float reduce16(__m512 a) {  // the same additions as `reduce16(const float*)`
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
#endif

// Which vector code `attend` runs: the widest built unless told otherwise (`use_kernels`: the tests
// compare them, which give the same bits for head sizes that are multiples of 16).
enum class Vectors { none, avx2, avx512 };
inline Vectors vectors = EXACT_ATTENTION_AVX512 ? Vectors::avx512 : EXACT_ATTENTION_AVX2 ? Vectors::avx2 : Vectors::none;

// e[j] = exp(e[j] − max e) for j < count, in place; returns Σ e[j]: 16 running sums (lane j mod 16),
// then `reduce16`
inline float normalize_weights(float* e, int64_t count) {
#if EXACT_ATTENTION_AVX512
  if (vectors == Vectors::avx512) {
    auto lanes = [count](int64_t j) { return count - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - j)) - 1); };
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < count; j += 16) most = _mm512_mask_max_ps(most, lanes(j), most, _mm512_maskz_loadu_ps(lanes(j), e + j));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(most));  // a maximum is exact in any order
    __m512 sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 16) {  // the tail through a mask, so every value takes the vector path
      const __m512 x = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes(j), e + j), shift));
      _mm512_mask_storeu_ps(e + j, lanes(j), x);
      sums = _mm512_mask_add_ps(sums, lanes(j), sums, x);
    }
    return reduce16(sums);
  }
#endif
  const float top = *std::max_element(e, e + count);
  float sums[16] = {};
  int64_t j = 0;
#if EXACT_ATTENTION_AVX2
  if (vectors == Vectors::avx2) {  // whole groups of 16 in two halves, the tail below as the portable code
    const __m256 shift = _mm256_set1_ps(top);
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (; j + 16 <= count; j += 16) {
      const __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), shift)), y = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j + 8), shift));
      _mm256_storeu_ps(e + j, x), _mm256_storeu_ps(e + j + 8, y);
      low = _mm256_add_ps(low, x), high = _mm256_add_ps(high, y);
    }
    _mm256_storeu_ps(sums, low), _mm256_storeu_ps(sums + 8, high);
  }
#endif
  for (; j < count; ++j) sums[j % 16] += (e[j] = exp_portable(e[j] - top));
  return reduce16(sums);
}

// The work of one (KV head, position): `heads` query heads q[g] (rows of d, `q_stride` apart) over the
// `count` slots `seen` of k and v (rows of d); out[g] (rows `out_stride` apart) = softmax(q[g] · k / √d) · v.
// `scores` holds heads × count floats, `totals` heads.
struct Group {
  const float* q;
  int64_t q_stride, heads;
  const float *k, *v;
  const int64_t* seen;
  int64_t count, d;
  float scale;
  float* out;
  int64_t out_stride;
};

// The vector codes (d = 16·C, C ≤ 8) take a task's positions a block of 16 slots at a time (`attend_positions`): a
// block's key rows, then its value rows, are read into the L1 cache once and serve every position and head there.
// Scores: a head's query is dotted with several key rows at once (independent chains of multiply-adds), whose partial
// sums are then reduced together (`reduce16x16`, `reduce4x16`) rather than one horizontal sum per slot, in
// `reduce16`'s order. Weighted values: sums [heads, d] in memory, each value row added in slot order.

#if EXACT_ATTENTION_AVX512
// The slot whose partial sums `reduce16x16` takes in input t, so that slot s comes out in lane s
constexpr int kSlotOf[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// acc[t] holds the 16 partial sums of slot kSlotOf[t]; returns the slots' sums, slot s in lane s, each added in
// `reduce16`'s order (partial l with l + 8, then + 4, + 2, + 1): 15 additions and 30 shuffles for 16 sums.
inline __m512 reduce16x16(const __m512 (&acc)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int k = 0; k < 8; ++k)  // lanes 0–7: a[l] + a[l+8] of input 2k, lanes 8–15 of input 2k+1
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // each 128-bit lane: b[l] + b[l+4] of one input
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // each pair of lanes: c[l] + c[l+2] of one input
    eighths[k] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),  // d[0] + d[1]
                       _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The scores of one head for a block of up to 16 slots: out[s] = (q · key row of slot s) · scale for the lanes s set
// in `lanes`, row(t) being the key row of slot kSlotOf[t]: per slot 16 lanes of C multiply-adds, then `reduce16`'s
// additions, as `attend_group_portable` computes them.
template <int C, typename Rows>
inline void score_block(const float* q, const Rows& row, float scale, __mmask16 lanes, float* out) {
  __m512 acc[16];
  const __m512 first = _mm512_loadu_ps(q);
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_mul_ps(first, _mm512_loadu_ps(row(t)));
  for (int u = 1; u < C; ++u) {
    const __m512 query = _mm512_loadu_ps(q + 16 * u);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(query, _mm512_loadu_ps(row(t) + 16 * u), acc[t]);
  }
  _mm512_mask_storeu_ps(out, lanes, _mm512_mul_ps(reduce16x16(acc), _mm512_set1_ps(scale)));
}

template <int C>
struct Avx512 {
  static constexpr int64_t d = 16 * C;

  // scores [heads, count]: the scores of block j0 (up to 16 of the slots `w` sees) for every head of the group
  static void score(const Group& w, int64_t j0, float* scores) {
    const int64_t m = std::min<int64_t>(16, w.count - j0);
    if (m == 16 && w.seen[j0 + 15] == w.seen[j0] + 15) {  // consecutive slots (a chain's): rows at fixed offsets
      const float* base = w.k + w.seen[j0] * d;
      const auto row = [base](int t) { return base + kSlotOf[t] * d; };
      for (int64_t g = 0; g < w.heads; ++g) score_block<C>(w.q + g * w.q_stride, row, w.scale, 0xffff, scores + g * w.count + j0);
    } else {  // a token tree's slots, or a last block of fewer: its last slot repeated in the lanes past m, not stored
      const float* key[16];
      for (int t = 0; t < 16; ++t) key[t] = w.k + w.seen[j0 + std::min<int64_t>(kSlotOf[t], m - 1)] * d;
      const auto row = [&key](int t) { return key[t]; };
      const __mmask16 lanes = __mmask16((1u << m) - 1);
      for (int64_t g = 0; g < w.heads; ++g) score_block<C>(w.q + g * w.q_stride, row, w.scale, lanes, scores + g * w.count + j0);
    }
  }

  // sums [heads, d] += the value rows of block j0 weighed by scores [heads, count], two heads per value row loaded
  static void weigh(const Group& w, int64_t j0, const float* scores, float* sums) {
    const int64_t end = std::min(j0 + 16, w.count);
    for (int64_t g0 = 0; g0 < w.heads; g0 += 2) {
      const int pair = w.heads - g0 >= 2 ? 2 : 1;
      __m512 acc[2][C];
      for (int b = 0; b < 2; ++b)
        for (int u = 0; u < C; ++u) acc[b][u] = _mm512_loadu_ps(sums + (g0 + (b < pair ? b : 0)) * d + 16 * u);
      for (int64_t j = j0; j < end; ++j) {
        const float* value = w.v + w.seen[j] * d;
        const __m512 w0 = _mm512_set1_ps(scores[g0 * w.count + j]);
        const __m512 w1 = _mm512_set1_ps(pair == 2 ? scores[(g0 + 1) * w.count + j] : 0.0f);
        for (int u = 0; u < C; ++u) {
          const __m512 x = _mm512_loadu_ps(value + 16 * u);
          acc[0][u] = _mm512_fmadd_ps(w0, x, acc[0][u]);
          acc[1][u] = _mm512_fmadd_ps(w1, x, acc[1][u]);  // unused for a lone last head
        }
      }
      for (int b = 0; b < pair; ++b)
        for (int u = 0; u < C; ++u) _mm512_storeu_ps(sums + (g0 + b) * d + 16 * u, acc[b][u]);
    }
  }
};
#endif

#if EXACT_ATTENTION_AVX2
// The sums of 4 slots' 16 partial sums (slot t's as two halves, low[t] and high[t]), [s0, s1, s2, s3], each added in
// `reduce16`'s order
inline __m128 reduce4x16(const __m256 (&low)[4], const __m256 (&high)[4]) {
  __m256 b[4];
  for (int t = 0; t < 4; ++t) b[t] = _mm256_add_ps(low[t], high[t]);  // a[l] + a[l+8]
  // b[l] + b[l+4]: slots 0 and 1, then 2 and 3, one per 128-bit lane
  const __m256 c01 = _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  const __m256 c23 = _mm256_add_ps(_mm256_permute2f128_ps(b[2], b[3], 0x20), _mm256_permute2f128_ps(b[2], b[3], 0x31));
  // c[l] + c[l+2]: [d0 d0 d2 d2 | d1 d1 d3 d3]
  const __m256 d = _mm256_add_ps(_mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 2, 3, 2)));
  // d[0] + d[1]: [s0 s2 s0 s2 | s1 s3 s1 s3]
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(d, d, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(d, d, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
}

template <int C>
struct Avx2 {
  static constexpr int64_t d = 16 * C;

  // scores [heads, count]: the scores of block j0 for every head of the group, 4 slots at a time (a slot's 16 partial
  // sums as two halves of 8); past the last slot the last one repeated, not stored
  static void score(const Group& w, int64_t j0, float* scores) {
    const int64_t m = std::min<int64_t>(16, w.count - j0);
    for (int64_t s0 = 0; s0 < m; s0 += 4) {
      const float* key[4];
      for (int t = 0; t < 4; ++t) key[t] = w.k + w.seen[j0 + std::min<int64_t>(s0 + t, m - 1)] * d;
      for (int64_t g = 0; g < w.heads; ++g) {
        const float* q = w.q + g * w.q_stride;
        __m256 low[4], high[4];
        for (int t = 0; t < 4; ++t) {
          low[t] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(key[t]));
          high[t] = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(key[t] + 8));
        }
        for (int u = 1; u < C; ++u) {
          const __m256 q_low = _mm256_loadu_ps(q + 16 * u), q_high = _mm256_loadu_ps(q + 16 * u + 8);
          for (int t = 0; t < 4; ++t) {
            low[t] = _mm256_fmadd_ps(q_low, _mm256_loadu_ps(key[t] + 16 * u), low[t]);
            high[t] = _mm256_fmadd_ps(q_high, _mm256_loadu_ps(key[t] + 16 * u + 8), high[t]);
          }
        }
        const __m128 four = _mm_mul_ps(reduce4x16(low, high), _mm_set1_ps(w.scale));
        float* out = scores + g * w.count + j0 + s0;
        if (m - s0 >= 4) {
          _mm_storeu_ps(out, four);
        } else {
          float lanes[4];
          _mm_storeu_ps(lanes, four);
          std::copy(lanes, lanes + (m - s0), out);
        }
      }
    }
  }

  // sums [heads, d] += the value rows of block j0 weighed by scores [heads, count], in runs of 64 columns (8 registers)
  static void weigh(const Group& w, int64_t j0, const float* scores, float* sums) {
    constexpr int kRun = 8;
    const int64_t end = std::min(j0 + 16, w.count);
    for (int64_t g = 0; g < w.heads; ++g)
      for (int64_t c0 = 0; c0 < d; c0 += 8 * kRun) {
        const int units = int(std::min<int64_t>(kRun, (d - c0) / 8));
        float* into = sums + g * d + c0;
        __m256 acc[kRun];
        for (int u = 0; u < units; ++u) acc[u] = _mm256_loadu_ps(into + 8 * u);
        for (int64_t j = j0; j < end; ++j) {
          const float* value = w.v + w.seen[j] * d + c0;
          const __m256 weight = _mm256_set1_ps(scores[g * w.count + j]);
          for (int u = 0; u < units; ++u) acc[u] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * u), acc[u]);
        }
        for (int u = 0; u < units; ++u) _mm256_storeu_ps(into + 8 * u, acc[u]);
      }
  }
};
#endif

#if EXACT_ATTENTION_AVX512 || EXACT_ATTENTION_AVX2
// Ask for the rows (of d floats, in `rows`) of the slots seen[j0 + 16 …] the block after j0 takes
inline void prefetch_next_block(const float* rows, const int64_t* seen, int64_t j0, int64_t count, int64_t d) {
  for (int64_t j = j0 + 16; j < std::min(j0 + 32, count); ++j)
    for (int64_t line = 0; line < d; line += 16) _mm_prefetch(reinterpret_cast<const char*>(rows + seen[j] * d + line), _MM_HINT_T0);
}

// The group's attention at `positions` positions (ws[p]: what position p sees) through a vector code, a block of 16
// slots at a time for every position: the positions see nearly the same slots (a chain's all but their last few), so
// each block of the cache is read from memory once for them all and then used from the L1 cache (the next block's
// rows on their way: measured inside a decode step, where the cache comes from memory). Per position p:
// scores[p] [heads, slots] (rows `count` apart), totals[p] [heads], sums[p] [heads, d].
template <typename Code>
void attend_positions(const Group* ws, int64_t positions, int64_t slots, float* scores, float* totals, float* sums) {
  constexpr int64_t d = Code::d;
  const int64_t heads = ws[0].heads;
  int64_t most = 0;
  for (int64_t p = 0; p < positions; ++p) most = std::max(most, ws[p].count);
  for (int64_t j0 = 0; j0 < most; j0 += 16)
    for (int64_t p = 0; p < positions; ++p)
      if (j0 < ws[p].count) {
        prefetch_next_block(ws[p].k, ws[p].seen, j0, ws[p].count, d);
        Code::score(ws[p], j0, scores + p * heads * slots);
      }
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t g = 0; g < heads; ++g) totals[p * heads + g] = normalize_weights(scores + p * heads * slots + g * ws[p].count, ws[p].count);
  std::fill(sums, sums + positions * heads * d, 0.0f);
  for (int64_t j0 = 0; j0 < most; j0 += 16)
    for (int64_t p = 0; p < positions; ++p)
      if (j0 < ws[p].count) {
        prefetch_next_block(ws[p].v, ws[p].seen, j0, ws[p].count, d);
        Code::weigh(ws[p], j0, scores + p * heads * slots, sums + p * heads * d);
      }
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t c = 0; c < d; ++c) ws[p].out[g * ws[p].out_stride + c] = sums[(p * heads + g) * d + c] / totals[p * heads + g];
}
#endif

// The same for any d, one head at a time, in plain C++ (CPUs without AVX2, odd head sizes): for d a
// multiple of 16 the vector code's operations (16 lanes of d / 16 multiply-adds, `reduce16`), so the
// same bits; otherwise one running sum over d.
inline void attend_group_portable(const Group& w, float* scores, float* totals) {
  for (int64_t g = 0; g < w.heads; ++g) {
    const float* q = w.q + g * w.q_stride;
    for (int64_t j = 0; j < w.count; ++j) {
      const float* key = w.k + w.seen[j] * w.d;
      float sum = 0.0f;
      if (w.d % 16 == 0) {
        float lanes[16];
        for (int l = 0; l < 16; ++l) lanes[l] = q[l] * key[l];
        for (int64_t i = 16; i < w.d; i += 16)
          for (int l = 0; l < 16; ++l) lanes[l] = std::fma(q[i + l], key[i + l], lanes[l]);
        sum = reduce16(lanes);
      } else {
        for (int64_t i = 0; i < w.d; ++i) sum = std::fma(q[i], key[i], sum);
      }
      scores[g * w.count + j] = sum * w.scale;
    }
    totals[g] = normalize_weights(scores + g * w.count, w.count);
    float* out = w.out + g * w.out_stride;
    for (int64_t c = 0; c < w.d; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < w.count; ++j) acc = std::fma(scores[g * w.count + j], w.v[w.seen[j] * w.d + c], acc);
      out[c] = acc / totals[g];
    }
  }
}

constexpr int64_t kPositionsPerTask = 8;  // the most positions a task takes (a prompt's piece is cut in runs of them)

// q [heads, n, head_dim] (the new positions' rotated queries), keys/values [kv_heads, capacity, head_dim]
// (one layer's cache, the new positions' keys and values already stored at slots start … start+n−1),
// mask: none for a chain (position i sees slots 0 … start+i), else bool [n, start+n] (a token tree:
// what each node sees). Returns [heads, n, head_dim].
inline at::Tensor attend(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                         const c10::optional<at::Tensor>& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "attend: q [heads, n, d], keys/values [kv_heads, capacity, d]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "attend: float32 only");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && keys.stride(1) == keys.size(2) && values.stride(1) == values.size(2),
              "attend: each slot's key and value must be contiguous rows");
  const int64_t heads = q_in.size(0), n = q_in.size(1), d = q_in.size(2), kv_heads = keys.size(0), slots = start + n;
  TORCH_CHECK(keys.size(2) == d && heads % kv_heads == 0 && slots <= keys.size(1), "attend: shapes do not match the cache");
  at::Tensor mask;
  if (mask_in.has_value()) {
    mask = mask_in->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == n && mask.size(1) == slots, "attend: the mask is [n, start + n]");
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({heads, n, d}, q.options());
  const bool* visible = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t group = heads / kv_heads;
  // A task: a KV head's group of query heads at consecutive positions (`pieces` runs of them), each block of the
  // cache read once for all. As few runs as keep every thread busy (the KV heads times the runs a multiple of the
  // threads: SmolLM2's 3 KV heads take 2 runs on 2 threads) and at most kPositionsPerTask positions a run (a
  // prompt's piece: the scores of a run stay small).
  const int64_t threads = at::get_num_threads();
  int64_t pieces = (threads + kv_heads - 1) / kv_heads;
  while (kv_heads * pieces % threads != 0) ++pieces;
  pieces = std::min(n, std::max(pieces, (n + kPositionsPerTask - 1) / kPositionsPerTask));
  const int64_t run = (n + pieces - 1) / pieces;
  pieces = (n + run - 1) / run;  // no empty run
  at::parallel_for(0, kv_heads * pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> seen(run * slots);  // per position of the run: the slots it sees, in slot order
    // per position: the group's weights [group, slots], their sums [group] and its weighted values [group, d]
    std::vector<float> scores(run * group * slots), totals(run * group), sums(run * group * d);
    std::vector<Group> ws;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / pieces, first = task % pieces * run, last = std::min(n, first + run);
      ws.clear();
      for (int64_t i = first; i < last; ++i) {
        int64_t* sees = seen.data() + (i - first) * slots;
        int64_t count = 0;
        for (int64_t j = 0; j < slots; ++j)
          if (visible ? visible[i * slots + j] : j <= start + i) sees[count++] = j;
        TORCH_CHECK(count > 0, "attend: every position must see at least one slot (row ", i, " of the mask is all False)");
        ws.push_back(Group{q.data_ptr<float>() + (kv * group * n + i) * d, n * d, group,
                           keys.data_ptr<float>() + kv * keys.stride(0), values.data_ptr<float>() + kv * values.stride(0),
                           sees, count, d, float(scale), out.data_ptr<float>() + (kv * group * n + i) * d, n * d});
      }
      const auto vector_code = [&](auto code) {  // the run through `code`, an `Avx512<C>` or `Avx2<C>`
        attend_positions<decltype(code)>(ws.data(), int64_t(ws.size()), slots, scores.data(), totals.data(), sums.data());
      };
#if EXACT_ATTENTION_AVX512
      if (vectors == Vectors::avx512 && d == 128) { vector_code(Avx512<8>{}); continue; }
      if (vectors == Vectors::avx512 && d == 64) { vector_code(Avx512<4>{}); continue; }
#endif
#if EXACT_ATTENTION_AVX2
      if (vectors == Vectors::avx2 && d == 128) { vector_code(Avx2<8>{}); continue; }
      if (vectors == Vectors::avx2 && d == 64) { vector_code(Avx2<4>{}); continue; }
#endif
      for (const Group& w : ws) attend_group_portable(w, scores.data(), totals.data());
    }
  });
  return out;
}

}  // namespace exact_attention
