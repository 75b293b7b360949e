// Linear layers on a GGUF file's own k-quant blocks (Q4_K, Q6_K) with int8 activations: the kernels
// of the `kquant` precision (see `models/kquant.py` for the why and the arithmetic).
//
// The weights are the file's: each 256-weight super-block keeps its scales and 4- or 6-bit values. At
// load they are repacked once into tiles of 16 output columns (`repack`), so that one 512-bit register
// holds four consecutive weights of each of the 16 columns. A VNNI dot product (`vpdpbusd`) then
// multiplies them with four activation bytes broadcast to every lane, and the 16 lanes of the result
// are the 16 columns' sums: no horizontal reduction, and the sub-block scales multiply whole lanes.
// A tile's weights are unpacked once and reused for up to 8 activation rows, so verifying up to 8
// positions reads the weights once (more: once per 8 rows, from cache). CPUs without AVX-512 VNNI run
// AVX2 tile kernels (`dot_tile_avx2`: two halves of 8 columns, `vpmaddubsw` and `vpmaddwd`). CPUs with AMX
// take 16 rows and 64 weights in one tile instruction (`dot_tile_amx`, from 9 rows: a prefill, wide
// verification): the same layout is its weight tile, and its integer sums are the AVX-512 code's.
//
// Exactness: every row is computed the same way whatever else the call holds. The products of a
// sub-block are summed in int32 (exact in any order), and the float work per super-block is a fixed
// sequence (convert, multiply, fused multiply-add) applied to each row on its own, in block order. The
// AVX2 and portable code (`dot_tile_portable`) perform the same integer sums and float operations, so
// they give the same bits as the AVX-512 code: the tests compare them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor casters, without the C++ frontend

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "decoder.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KQ_AVX512 1
#else
#define KQ_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_AVX2 1
#else
#define KQ_AVX2 0
#endif
#if KQ_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define KQ_AMX 1
#else
#define KQ_AMX 0
#endif
#if KQ_AVX512 || KQ_AVX2
#include <immintrin.h>
#endif
#if KQ_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int kBlock = 256;  // weights per super-block (QK_K)
constexpr int kCols = 16;    // output columns per tile
constexpr int kRows = 8;     // activation rows per pass over a tile (the vector code)
constexpr int kWideRows = 16;  // activation rows per AMX tile multiply

enum Kind : int64_t { Q4_K = 12, Q6_K = 14 };  // ggml's type numbers

// raw GGUF block sizes in bytes
constexpr int kQ4KRaw = 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
constexpr int kQ6KRaw = 210;  // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d

// repacked tile-block sizes (16 columns × 256 weights)
constexpr int kQ4KTile = 2 * 32 + 2 * 8 * 16 + 8 * 256;  // d, dmin [16] fp16; sc [8][16], m [4][16][2] u8; nibbles
constexpr int kQ6KTile = 32 + 16 * 16 + 16 * 192;        // d [16] fp16; sc [16][16] i8; 6-bit values [16][192]

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = mantissa;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K block (ggml's packing of 12 bytes).
void q4k_scale_min(const uint8_t* s, int j, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The 4-bit value k (0..255) of a Q4_K block: 64 values per 32 bytes, low nibbles first.
uint8_t q4k_value(const uint8_t* qs, int k) {
  const int chunk = k / 64, l = k % 32;
  const uint8_t byte = qs[32 * chunk + l];
  return (k % 64) < 32 ? (byte & 0xf) : (byte >> 4);
}

// The 6-bit value k (0..255) of a Q6_K block, 0..63 (the weight is d · scale[k / 16] · (value − 32)).
uint8_t q6k_value(const uint8_t* ql, const uint8_t* qh, int k) {
  const int half = k / 128, r = k % 128, group = r / 32, l = r % 32;
  ql += 64 * half;
  qh += 32 * half;
  const uint8_t low = group == 0 ? (ql[l] & 0xf) : group == 1 ? (ql[l + 32] & 0xf) : group == 2 ? (ql[l] >> 4) : (ql[l + 32] >> 4);
  const uint8_t high = (qh[l] >> (2 * group)) & 3;
  return low | (high << 4);
}

// A repacked Q6_K sub-block (16 columns × 16 values) in 192 bytes: value (lane, t) — lane = 4 · column + i
// holds k = 4t + i — keeps its low 4 bits in byte 64 · (t / 2) + lane (low nibble for even t, high for odd)
// and its high 2 bits at bit 2t of byte 128 + lane.
void q6k_store(uint8_t* sub, int t, int lane, uint8_t value) {
  sub[64 * (t / 2) + lane] |= (value & 0xf) << (4 * (t % 2));
  sub[128 + lane] |= (value >> 4) << (2 * t);
}

uint8_t q6k_load(const uint8_t* sub, int t, int lane) {
  return ((sub[64 * (t / 2) + lane] >> (4 * (t % 2))) & 0xf) | (((sub[128 + lane] >> (2 * t)) & 3) << 4);
}

int64_t raw_bytes(int64_t kind) { return kind == Q4_K ? kQ4KRaw : kQ6KRaw; }
int64_t tile_bytes(int64_t kind) { return kind == Q4_K ? kQ4KTile : kQ6KTile; }

void check_kind(int64_t kind) {
  TORCH_CHECK(kind == Q4_K || kind == Q6_K, "kquant kernels take Q4_K (12) and Q6_K (14) blocks, not type ", kind);
}

// One tile-block from the raw blocks of 16 columns (`rows[c]` points at column c's block, or is null
// for a padding column, whose weights are zero).
void repack_block(int64_t kind, const uint8_t* const* rows, uint8_t* out) {
  if (kind == Q4_K) {
    uint8_t* nibbles = out + 2 * 32 + 2 * 8 * 16;
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* raw = rows[c];
      if (raw) {  // d and dmin (a padding column keeps the zeroed bytes)
        std::memcpy(out + 2 * c, raw, 2);
        std::memcpy(out + 32 + 2 * c, raw + 2, 2);
      }
      for (int j = 0; j < 8; ++j) {
        uint8_t scale = 0, min = 0;
        if (raw) q4k_scale_min(raw + 4, j, scale, min);
        out[64 + 16 * j + c] = scale;
        out[64 + 128 + 32 * (j / 2) + 2 * c + j % 2] = min;  // pairs of sub-blocks side by side, for vpdpwssd
        for (int t = 0; t < 4; ++t)
          for (int i = 0; i < 4; ++i) {
            const uint8_t lo = raw ? q4k_value(raw + 16, 32 * j + 4 * t + i) : 0;
            const uint8_t hi = raw ? q4k_value(raw + 16, 32 * j + 4 * (t + 4) + i) : 0;
            nibbles[256 * j + 64 * t + 4 * c + i] = lo | (hi << 4);
          }
      }
    }
  } else {
    uint8_t* values = out + 32 + 16 * 16;
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* raw = rows[c];
      if (raw) std::memcpy(out + 2 * c, raw + 208, 2);
      for (int j = 0; j < 16; ++j) {
        out[32 + 16 * j + c] = raw ? raw[192 + j] : 0;
        for (int t = 0; t < 4; ++t)
          for (int i = 0; i < 4; ++i)
            q6k_store(values + 192 * j, t, 4 * c + i, raw ? q6k_value(raw, raw + 128, 16 * j + 4 * t + i) : 32);
      }
    }
  }
}

// Activations of one call, quantized per row and super-block (ggml's Q8_K, with rounding half to even):
// d = absmax / 127, q = round(x / d), and the sums of q over each 16 values.
struct Activations {
  const int8_t* q;            // [rows, K]
  const float* d;             // [rows, K / 256]
  const int32_t* sums;        // [rows, K / 16]
  const int16_t* pair_sums;   // [rows, K / 32]: the sums over each 32 values (Q4_K's sub-blocks)
  int64_t k, blocks;
  int64_t width;  // the input's own width (≤ K): past it every value is zero (a requantized draft's rows padded); K
                  // where the kernels read a padded layer whole (`skip_padding` off)

  // The sub-blocks of `size` values in super-block b that hold any of the input. Past them every product is zero,
  // so the vector and AMX kernels skip them (a padded layer's weights are not read) and their sums stay the same.
  int sub_blocks(int64_t b, int size) const { return int((std::min<int64_t>(kBlock, width - b * kBlock) + size - 1) / size); }
};

// f(j) for the sub-blocks j < subs of a super-block of Full sub-blocks (`Activations::sub_blocks`). A whole block,
// every block but a padded layer's last, runs a loop of constant length, which the compiler unrolls and schedules
// as one: bounded by `subs` alone, the AVX-512 kernels' 8-row passes ran slower (verification and prefill; the AVX2
// kernels keep that loop, where this form measured slower: BENCHMARKS.md, AVX-512, 2026-11-28)
template <int Full, typename F>
inline void for_sub_blocks(int subs, F&& f) {
  if (subs == Full) {
    for (int j = 0; j < Full; ++j) f(j);
  } else {
    for (int j = 0; j < subs; ++j) f(j);
  }
}

// f(std::integral_constant<int, R>{}) for R = rows (1 … kRows): the vector tile kernels are compiled per row count
template <typename F>
void with_rows(int rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, kRows>{});
  }
}

// ---------------------------------------------------------------------------------------------------
// The portable tile kernel: y[r][c] for `rows` rows and one tile of 16 columns, in the AVX-512 code's
// order of float operations.
void dot_tile_portable(int64_t kind, const uint8_t* tile, const Activations& a, int64_t row0, int rows, float* acc) {
  for (int r = 0; r < rows; ++r) {
    const int8_t* q = a.q + (row0 + r) * a.k;
    const float* d = a.d + (row0 + r) * a.blocks;
    const int32_t* sums = a.sums + (row0 + r) * (a.k / 16);
    float* y = acc + r * kCols;
    for (int c = 0; c < kCols; ++c) y[c] = 0.0f;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* t = tile + b * tile_bytes(kind);
      const int8_t* qb = q + b * kBlock;
      const int32_t* sb = sums + b * 16;
      for (int c = 0; c < kCols; ++c) {
        if (kind == Q4_K) {
          const uint8_t* nibbles = t + 2 * 32 + 2 * 8 * 16;
          int32_t dot = 0, mins = 0;
          for (int j = 0; j < 8; ++j) {
            int32_t sub = 0;
            for (int tt = 0; tt < 8; ++tt)
              for (int i = 0; i < 4; ++i) {
                const uint8_t byte = nibbles[256 * j + 64 * (tt % 4) + 4 * c + i];
                sub += int32_t(tt < 4 ? (byte & 0xf) : (byte >> 4)) * qb[32 * j + 4 * tt + i];
              }
            dot += sub * int32_t(t[64 + 16 * j + c]);
          }
          for (int j = 0; j < 8; ++j) mins += int32_t(t[192 + 32 * (j / 2) + 2 * c + j % 2]) * (sb[2 * j] + sb[2 * j + 1]);
          const float scale = half_to_float(read_u16(t + 2 * c)) * d[b];
          const float min_scale = half_to_float(read_u16(t + 32 + 2 * c)) * d[b];
          y[c] = std::fma(float(dot), scale, y[c]);
          y[c] = std::fma(-float(mins), min_scale, y[c]);
        } else {
          const uint8_t* values = t + 32 + 16 * 16;
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) {
            int32_t sub = 0;
            for (int tt = 0; tt < 4; ++tt)
              for (int i = 0; i < 4; ++i) sub += int32_t(q6k_load(values + 192 * j, tt, 4 * c + i)) * qb[16 * j + 4 * tt + i];
            sub -= 32 * sb[j];
            dot += sub * int32_t(int8_t(t[32 + 16 * j + c]));
          }
          const float scale = half_to_float(read_u16(t + 2 * c)) * d[b];
          y[c] = std::fma(float(dot), scale, y[c]);
        }
      }
    }
  }
}

bool prefetch_few_rows = false;  // the vector code prefetches for one and two rows too (`set_prefetch_few_rows`)
// Whether the kernels skip a padded layer's sub-blocks past its input (`Activations::sub_blocks`; `set_skip_padding`):
// fewer bytes read, but a hole in the weight stream at every tile, which on the Zen 5 EPYC slowed SmolLM2's 576-wide
// layers 1.4–1.6× where on the AMX Xeon skipping gained; `models/kquant.settle_padding` measures it. The same bits
// either way: the products past the input are zeros.
bool skip_padding = true;

#if KQ_AVX512 || KQ_AVX2
// Ask for the tile-block `kAhead` blocks further on, a share of its cache lines per sub-block step (part `j` of `steps`),
// so the weight stream keeps reads in flight while a block computes (when: `kPrefetchQ4K` and `dot_tile_avx2` below)
constexpr int kAhead = 2;
inline void prefetch_ahead(const uint8_t* block, int bytes, int j, int steps) {
  const int lines = (bytes + 63) / 64, per_step = (lines + steps - 1) / steps;
  const uint8_t* ahead = block + kAhead * bytes;
  for (int line = j * per_step; line < std::min(lines, (j + 1) * per_step); ++line)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
}
#endif

#if KQ_AVX512
// ---------------------------------------------------------------------------------------------------
// The AVX-512 VNNI tile kernels, for R rows at once (the weights of a sub-block are unpacked once into
// registers and used by every row).
inline __m512i broadcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

// acc += w · (the four bytes at p, in every lane), with the broadcast folded into the instruction
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// When the AVX-512 code prefetches: always where a block's work is long (Q4_K from 3 rows, Q6_K from 2: on the
// AVX-512 EPYC of BENCHMARKS.md, whole-model T(4)/T(1) went from 1.65–1.89 to 1.42 with this rule;
// `kernel_candidates.py`, `kquant_streaming.py` measure it). For fewer rows it depends on the CPU: on the AMX Xeon a
// decode step's Q6_K blocks gain (a step's linear layers 10 % faster) and its Q4_K blocks lose (4 % at one row, 10 % at
// two), on the Zen 5 EPYC both gain (11 %); so there it is `prefetch_few_rows`, which `models/kquant.py` sets from a
// measurement on this CPU (BENCHMARKS.md).
template <int R>
constexpr bool kPrefetchQ4K = R >= 3;
template <int R>
constexpr bool kPrefetchQ6K = R >= (KQ_AMX ? 1 : 2);

// Independent accumulation chains per row: with 1–2 rows a row's dot products are split over two chains
// (a dot product's latency would stall one chain); with more rows, the rows' chains interleave.
template <int R>
constexpr int kChains = R <= 2 ? 2 : 1;

template <int R>
inline __m512i chain_sum(const __m512i* chains) {
  if constexpr (kChains<R> == 2) return _mm512_add_epi32(chains[0], chains[1]);
  else return chains[0];
}

// dot[r] += scale · (row r's sub-block sums) for R rows: the sub-block's T groups of 4 weights w[t] times
// row r's activation bytes at `offset` + 4t, the rows' dot-product chains interleaved, row r's sum seeded
// with start[r].
template <int R, int T>
inline void add_sub_block(const __m512i* w, __m512i scale, const Activations& a, int64_t row0, int64_t offset,
                          const __m512i* start, __m512i* dot) {
  __m512i sub[R][kChains<R>];
  for (int r = 0; r < R; ++r) {
    sub[r][0] = start[r];
    if constexpr (kChains<R> > 1) sub[r][1] = _mm512_setzero_si512();
  }
  for (int tt = 0; tt < T; ++tt)
    for (int r = 0; r < R; ++r)
      sub[r][tt % kChains<R>] = dot4(sub[r][tt % kChains<R>], w[tt], a.q + (row0 + r) * a.k + offset + 4 * tt);
  for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], _mm512_mullo_epi32(chain_sum<R>(sub[r]), scale));
}

template <int R, bool Prefetch>
void dot_tile_q4k(const uint8_t* tile, const Activations& a, int64_t row0, float* acc) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i zeros[R];
  for (int r = 0; r < R; ++r) zeros[r] = _mm512_setzero_si512();
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* t = tile + b * kQ4KTile;
    const uint8_t* nibbles = t + 2 * 32 + 2 * 8 * 16;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for_sub_blocks<8>(a.sub_blocks(b, 32), [&](int j) {
      if constexpr (Prefetch) prefetch_ahead(t, kQ4KTile, j, 8);
      __m512i w[8];
      for (int tt = 0; tt < 4; ++tt) {
        const __m512i packed = _mm512_loadu_si512(nibbles + 256 * j + 64 * tt);
        w[tt] = _mm512_and_si512(packed, low);
        w[tt + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      }
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 64 + 16 * j)));
      add_sub_block<R, 8>(w, scale, a, row0, b * kBlock + 32 * j, zeros, dot);
    });
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    __m512i min_pairs[4];  // [16 columns × (m of sub-block 2i, m of 2i + 1)] int16
    for (int i = 0; i < 4; ++i) min_pairs[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 192 + 32 * i)));
    for (int r = 0; r < R; ++r) {
      const int16_t* pairs = a.pair_sums + (row0 + r) * (a.k / 32) + b * 8;  // the row's sums over each 32 values
      __m512i mins = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) {
        int32_t pair;
        std::memcpy(&pair, pairs + 2 * i, 4);
        mins = _mm512_dpwssd_epi32(mins, min_pairs[i], _mm512_set1_epi32(pair));
      }
      const __m512 xd = _mm512_set1_ps(a.d[(row0 + r) * a.blocks + b]);
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, xd), y[r]);
      y[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, xd), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kCols, y[r]);
}

// A repacked Q6_K sub-block (`q6k_store`) unpacked: w[t] holds values 4t … 4t + 3 of each of the 16 columns
inline void unpack_q6k(const uint8_t* packed, __m512i* w) {
  const __m512i nibble = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
  const __m512i low0 = _mm512_loadu_si512(packed), low1 = _mm512_loadu_si512(packed + 64), high = _mm512_loadu_si512(packed + 128);
  w[0] = _mm512_or_si512(_mm512_and_si512(low0, nibble), _mm512_and_si512(_mm512_slli_epi16(high, 4), top));
  w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low0, 4), nibble), _mm512_and_si512(_mm512_slli_epi16(high, 2), top));
  w[2] = _mm512_or_si512(_mm512_and_si512(low1, nibble), _mm512_and_si512(high, top));
  w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low1, 4), nibble), _mm512_and_si512(_mm512_srli_epi16(high, 2), top));
}

template <int R, bool Prefetch>
void dot_tile_q6k(const uint8_t* tile, const Activations& a, int64_t row0, float* acc) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* t = tile + b * kQ6KTile;
    const uint8_t* values = t + 32 + 16 * 16;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for_sub_blocks<16>(a.sub_blocks(b, 16), [&](int j) {
      if constexpr (Prefetch) prefetch_ahead(t, kQ6KTile, j, 16);
      __m512i w[4];  // the 6-bit values of the sub-block, unpacked
      unpack_q6k(values + 192 * j, w);
      const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * j)));
      __m512i start[R];  // minus 32 · (the activations' sum): the weights are stored as value + 32
      for (int r = 0; r < R; ++r) start[r] = _mm512_set1_epi32(-32 * a.sums[(row0 + r) * (a.k / 16) + b * 16 + j]);
      add_sub_block<R, 4>(w, scale, a, row0, b * kBlock + 16 * j, start, dot);
    });
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    for (int r = 0; r < R; ++r) {
      const __m512 xd = _mm512_set1_ps(a.d[(row0 + r) * a.blocks + b]);
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, xd), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kCols, y[r]);
}

void dot_tile_avx512(int64_t kind, const uint8_t* tile, const Activations& a, int64_t row0, int rows, float* acc) {
  with_rows(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    if (kind == Q4_K) {
      if (kPrefetchQ4K<R> || prefetch_few_rows) dot_tile_q4k<R, true>(tile, a, row0, acc);
      else dot_tile_q4k<R, false>(tile, a, row0, acc);
    } else {
      if (kPrefetchQ6K<R> || prefetch_few_rows) dot_tile_q6k<R, true>(tile, a, row0, acc);
      else dot_tile_q6k<R, false>(tile, a, row0, acc);
    }
  });
}
#endif

#if KQ_AMX
// ---------------------------------------------------------------------------------------------------
// The AMX kernel, for many rows at once (a prompt's prefill, wide verification). Per tile and super-block the
// sub-block scales are folded into the weights once: w = value · scale (Q4_K: 0 … 945; Q6_K, its offset of 32 too:
// (value − 32) · scale, −4,064 … 4,096) as
// a low byte (unsigned) and a high byte (signed) in the tile multiply's layout (four consecutive weights of each
// column in 64 bytes, as `repack` keeps them); then every 16 rows of activations take four `tdpbsud` on the low
// bytes and four `tdpbssd` on the high bytes (64 weights each), and low + 256 · high is the super-block's sum the
// vector code builds sub-block by sub-block: the same integer, then the same float work, so the same bits.
constexpr int kAmxFromRows = 9;  // fewer: the AVX-512 code, one pass of 8 rows (folding the scales costs more than it saves)

// Linux lends a process the AMX tile registers only when asked (once; every thread then has them)
bool amx_permitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

// Two groups of up to 16 activation rows share each weight tile load: tiles 0 and 1 hold the first group's sums
// over the low and the high bytes, [rows × 16] int32, tiles 2 and 3 the second's; tiles 4 and 5: the groups' 64
// activations a row; tiles 6 and 7: 64 weights of the 16 columns, low and high bytes (16 rows of 64 bytes). Four
// independent sums keep the tile unit busy where one group's two waited on each other and on their one weight tile.
void configure_tiles(int first, int second) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  const int rows[8] = {first, first, second, second, first, second, kWideRows, kWideRows};
  for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = uint8_t(rows[i]);
  _tile_loadconfig(&config);
}

// A column's scale (int32 lanes, |s| < 2^15) in both 16-bit halves of its lane
inline __m512i twice16_512(__m512i scale) {
  return _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(scale, 16));
}

// Weight row `w` (64 unsigned values: four of each column) minus `offset`, times its columns' scales: the int16
// products' low bytes to `low`, high bytes to `high`, each in w's layout.
inline void fold_row(__m512i w, __m512i scale16, __m512i offset16, uint8_t* low, uint8_t* high) {
  const __m512i byte = _mm512_set1_epi16(0x00ff);
  const __m512i even = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(w, byte), offset16), scale16);
  const __m512i odd = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16(w, 8), offset16), scale16);
  _mm512_store_si512(low, _mm512_or_si512(_mm512_and_si512(even, byte), _mm512_slli_epi16(odd, 8)));
  _mm512_store_si512(high, _mm512_or_si512(_mm512_srli_epi16(even, 8), _mm512_andnot_si512(byte, odd)));
}

// A tile-block's 256 weights of 16 columns, scales folded in: low, high [64 rows × 64 bytes] (row t: weights
// 4t … 4t + 3 of each column)
void fold_q4k(const uint8_t* t, int subs, uint8_t* low, uint8_t* high) {  // sub-blocks j < subs
  const __m512i nibble = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  const uint8_t* nibbles = t + 2 * 32 + 2 * 8 * 16;
  for (int j = 0; j < subs; ++j) {
    prefetch_ahead(t, kQ4KTile, j, 8);  // the weight stream keeps reads in flight while the tile multiplies run
    const __m512i scale = twice16_512(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 64 + 16 * j))));
    for (int tt = 0; tt < 4; ++tt) {  // as `dot_tile_q4k` unpacks them: rows 8j + tt (low nibbles) and 8j + tt + 4
      const __m512i packed = _mm512_loadu_si512(nibbles + 256 * j + 64 * tt);
      const int row = 8 * j + tt;
      fold_row(_mm512_and_si512(packed, nibble), scale, zero, low + 64 * row, high + 64 * row);
      fold_row(_mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble), scale, zero, low + 64 * (row + 4), high + 64 * (row + 4));
    }
  }
}

void fold_q6k(const uint8_t* t, int subs, uint8_t* low, uint8_t* high) {  // the values are stored as value + 32
  const __m512i offset = _mm512_set1_epi16(32);
  const uint8_t* values = t + 32 + 16 * 16;
  for (int j = 0; j < subs; ++j) {
    prefetch_ahead(t, kQ6KTile, j, 16);
    const __m512i scale = twice16_512(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * j))));
    __m512i w[4];  // rows 4j … 4j + 3
    unpack_q6k(values + 192 * j, w);
    for (int tt = 0; tt < 4; ++tt) fold_row(w[tt], scale, offset, low + 64 * (4 * j + tt), high + 64 * (4 * j + tt));
  }
}

// y [rows × 16, row stride `ldy`] = every row of `a` through one tile of 16 columns (rows ≥ kAmxFromRows)
void dot_tile_amx(int64_t kind, const uint8_t* tile, const Activations& a, int64_t rows, float* y, int64_t ldy) {
  alignas(64) uint8_t low[64 * 64], high[64 * 64];
  alignas(64) int32_t sums_low[2 * kWideRows * kCols], sums_high[2 * kWideRows * kCols];
  for (int64_t row = 0; row < rows; ++row) _mm512_storeu_ps(y + ldy * row, _mm512_setzero_ps());
  int configured[2] = {0, 0};
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* t = tile + b * tile_bytes(kind);
    // the quarters (64 values) that hold any of the input; the rows a quarter holds past the last folded sub-block
    // are an earlier block's, times zero activations
    const int quarters = a.sub_blocks(b, 64);
    if (kind == Q4_K) fold_q4k(t, a.sub_blocks(b, 32), low, high);
    else fold_q6k(t, a.sub_blocks(b, 16), low, high);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));  // Q4_K
    __m512i min_pairs[4];  // Q4_K: the mins of sub-blocks (2i, 2i + 1), int16
    if (kind == Q4_K)
      for (int i = 0; i < 4; ++i) min_pairs[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 192 + 32 * i)));
    for (int64_t row0 = 0; row0 < rows; row0 += 2 * kWideRows) {
      const int first = int(std::min<int64_t>(kWideRows, rows - row0));
      const int second = int(std::clamp<int64_t>(rows - row0 - kWideRows, 0, kWideRows));
      if (first != configured[0] || second != configured[1]) {
        configured[0] = first, configured[1] = second;
        configure_tiles(first, second ? second : kWideRows);  // no second group: its tiles stay unused
      }
      const int8_t* activations = a.q + row0 * a.k + b * kBlock;
      _tile_zero(0);
      _tile_zero(1);
      if (second) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int quarter = 0; quarter < quarters; ++quarter) {
        _tile_loadd(6, low + 1024 * quarter, 64);
        _tile_loadd(7, high + 1024 * quarter, 64);
        _tile_loadd(4, activations + 64 * quarter, a.k);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (second) {
          _tile_loadd(5, activations + kWideRows * a.k + 64 * quarter, a.k);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
      }
      _tile_stored(0, sums_low, 64);
      _tile_stored(1, sums_high, 64);
      if (second) {
        _tile_stored(2, sums_low + kWideRows * kCols, 64);
        _tile_stored(3, sums_high + kWideRows * kCols, 64);
      }
      const int n = first + second;
      for (int r = 0; r < n; ++r) {
        const int64_t row = row0 + r;
        __m512i dot = _mm512_add_epi32(_mm512_load_si512(sums_low + kCols * r), _mm512_slli_epi32(_mm512_load_si512(sums_high + kCols * r), 8));
        const __m512 xd = _mm512_set1_ps(a.d[row * a.blocks + b]);
        __m512 acc = _mm512_loadu_ps(y + ldy * row);
        if (kind == Q4_K) {  // the mins as in `dot_tile_q4k`
          const int16_t* sub_sums = a.pair_sums + row * (a.k / 32) + b * 8;  // the row's sums over each 32 values
          __m512i mins = _mm512_setzero_si512();
          for (int i = 0; i < 4; ++i) {
            int32_t pair;
            std::memcpy(&pair, sub_sums + 2 * i, 4);
            mins = _mm512_dpwssd_epi32(mins, min_pairs[i], _mm512_set1_epi32(pair));
          }
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, xd), acc);
          acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, xd), acc);
        } else {  // the offset of 32 is in the folded weights
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, xd), acc);
        }
        _mm512_storeu_ps(y + ldy * row, acc);
      }
    }
  }
  _tile_release();
}
#endif

#if KQ_AVX2
// ---------------------------------------------------------------------------------------------------
// The AVX2 tile kernels (CPUs without AVX-512 VNNI): a tile's 16 columns as two halves of 8 (a 256-bit
// register holds four weights of each of 8 columns). Without VNNI, `vpmaddubsw` multiplies the unsigned
// weights with the signed activation bytes into 16-bit sums of two products: at most 2 · 63 · 128 = 16,128,
// so no saturation, and the int16 sums of a Q4_K sub-block (8 of them, each ≤ 2 · 15 · 128) or of half a
// Q6_K sub-block (2, each ≤ 16,128) stay below 32,767. `vpmaddwd` with the sub-block scale in both 16-bit
// halves of a column's lane then gives the column's scaled sum in int32. Every integer is the AVX-512
// code's, and the float work per super-block is the same sequence, so the bits are the same.

// a column's scale (int32 lanes, |s| < 2^15) in both 16-bit halves of its lane, for `vpmaddwd`
inline __m256i twice16(__m256i scale) { return _mm256_or_si256(_mm256_and_si256(scale, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(scale, 16)); }

inline __m256i broadcast4_avx2(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

// Register pressure: an AVX2-only CPU has 16 vector registers. A tile is worked through one half (8 columns)
// at a time, over every super-block, so a row keeps one float accumulator, and a sub-block's 32 weights are
// unpacked into eight registers once, then each row's eight products are summed in int16 and scaled into its
// int32 dot product. The integer sums are exact in any order, and each column's float operations run in block
// order as in the AVX-512 code, so the bits are the same.
template <int R, bool Prefetch>
void dot_tile_q4k_avx2(const uint8_t* tile, const Activations& a, int64_t row0, float* acc) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int h = 0; h < 2; ++h) {
    __m256 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* t = tile + b * kQ4KTile;
      const uint8_t* nibbles = t + 2 * 32 + 2 * 8 * 16;
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int j = 0, subs = a.sub_blocks(b, 32); j < subs; ++j) {
        if constexpr (Prefetch) if (h == 0) prefetch_ahead(t, kQ4KTile, j, 8);  // the second half finds the tile cached
        const __m256i scale = twice16(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 64 + 16 * j + 8 * h))));
        __m256i w[8];  // w[i]: weights 4i … 4i + 3 of each column (low nibbles: i < 4; high: i ≥ 4)
        for (int i = 0; i < 4; ++i) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 256 * j + 64 * i + 32 * h));
          w[i] = _mm256_and_si256(packed, low);
          w[4 + i] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a.q + (row0 + r) * a.k + b * kBlock + 32 * j;
          __m256i even = _mm256_maddubs_epi16(w[0], broadcast4_avx2(q)), odd = _mm256_maddubs_epi16(w[1], broadcast4_avx2(q + 4));
          for (int i = 2; i < 8; i += 2) {
            even = _mm256_add_epi16(even, _mm256_maddubs_epi16(w[i], broadcast4_avx2(q + 4 * i)));
            odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(w[i + 1], broadcast4_avx2(q + 4 * i + 4)));
          }
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(even, odd), scale));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * h)));
      __m256i min_pairs[4];  // [8 columns × (m of sub-block 2i, m of 2i + 1)] int16, unpacked once for every row
      for (int i = 0; i < 4; ++i) min_pairs[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 192 + 32 * i + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int16_t* pairs = a.pair_sums + (row0 + r) * (a.k / 32) + b * 8;
        __m256i mins = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          int32_t pair;
          std::memcpy(&pair, pairs + 2 * i, 4);
          mins = _mm256_add_epi32(mins, _mm256_madd_epi16(min_pairs[i], _mm256_set1_epi32(pair)));
        }
        const __m256 xd = _mm256_set1_ps(a.d[(row0 + r) * a.blocks + b]);
        y[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, xd), y[r]);
        y[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, xd), y[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * kCols + 8 * h, y[r]);
  }
}

template <int R, bool Prefetch>
void dot_tile_q6k_avx2(const uint8_t* tile, const Activations& a, int64_t row0, float* acc) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {  // a half (8 columns) over every super-block, as in the Q4_K kernel
    __m256 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* t = tile + b * kQ6KTile;
      const uint8_t* values = t + 32 + 16 * 16;
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int j = 0, subs = a.sub_blocks(b, 16); j < subs; ++j) {
        if constexpr (Prefetch) if (h == 0) prefetch_ahead(t, kQ6KTile, j, 16);
        const __m256i scale = twice16(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 + 16 * j + 8 * h))));
        const uint8_t* packed = values + 192 * j + 32 * h;
        const __m256i low0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
        const __m256i low1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 128));
        const __m256i w0 = _mm256_or_si256(_mm256_and_si256(low0, nibble), _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
        const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), nibble), _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
        const __m256i w2 = _mm256_or_si256(_mm256_and_si256(low1, nibble), _mm256_and_si256(high, top));
        const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a.q + (row0 + r) * a.k + b * kBlock + 16 * j;
          const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(w0, broadcast4_avx2(q)), _mm256_maddubs_epi16(w1, broadcast4_avx2(q + 4)));
          const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(w2, broadcast4_avx2(q + 8)), _mm256_maddubs_epi16(w3, broadcast4_avx2(q + 12)));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(_mm256_madd_epi16(first, scale), _mm256_madd_epi16(second, scale)));
        }
      }
      // the weights are stored as value + 32: minus 32 · Σ_j scale_j · (the activations' sum over sub-block j),
      // two sub-blocks per `vpmaddwd` (|sum| ≤ 16 · 128 fits 16 bits)
      __m256i pairs[8];  // [8 columns × (scale of sub-block 2i, of 2i + 1)] int16, unpacked once for every row
      for (int i = 0; i < 8; ++i)
        pairs[i] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 + 16 * (2 * i) + 8 * h)),
                                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 32 + 16 * (2 * i + 1) + 8 * h))));
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int32_t* sums = a.sums + (row0 + r) * (a.k / 16) + b * 16;
        __m256i offset = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i)
          offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pairs[i], _mm256_set1_epi32(int32_t((uint32_t(sums[2 * i]) & 0xffffu) | (uint32_t(sums[2 * i + 1]) << 16)))));
        const __m256i total = _mm256_sub_epi32(dot[r], _mm256_slli_epi32(offset, 5));
        const __m256 xd = _mm256_set1_ps(a.d[(row0 + r) * a.blocks + b]);
        y[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, xd), y[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * kCols + 8 * h, y[r]);
  }
}

void dot_tile_avx2(int64_t kind, const uint8_t* tile, const Activations& a, int64_t row0, int rows, float* acc) {
  with_rows(rows, [&](auto r) {  // prefetching for one and two rows where `prefetch_few_rows`, never from three
    constexpr int R = decltype(r)::value;
    const bool prefetch = R < 3 && prefetch_few_rows;
    if (kind == Q4_K) prefetch ? dot_tile_q4k_avx2<R, true>(tile, a, row0, acc) : dot_tile_q4k_avx2<R, false>(tile, a, row0, acc);
    else prefetch ? dot_tile_q6k_avx2<R, true>(tile, a, row0, acc) : dot_tile_q6k_avx2<R, false>(tile, a, row0, acc);
  });
}
#endif

// Which tile code runs: the fastest built, unless `use_kernels` says otherwise (the tests compare them).
enum class Kernels { portable, avx2, avx512, amx };

bool amx_usable() {
#if KQ_AMX
  return amx_permitted();
#else
  return false;
#endif
}

Kernels kernels = amx_usable() ? Kernels::amx : KQ_AVX512 ? Kernels::avx512 : KQ_AVX2 ? Kernels::avx2 : Kernels::portable;

void dot_tile(int64_t kind, const uint8_t* tile, const Activations& a, int64_t row0, int rows, float* acc) {
  switch (kernels) {
#if KQ_AVX512
    case Kernels::amx:  // a pass of few rows: the AVX-512 code
    case Kernels::avx512: return dot_tile_avx512(kind, tile, a, row0, rows, acc);
#endif
#if KQ_AVX2
    case Kernels::avx2: return dot_tile_avx2(kind, tile, a, row0, rows, acc);
#endif
    default: return dot_tile_portable(kind, tile, a, row0, rows, acc);
  }
}

// One weight of a layer: its packed tiles, block type, output columns and first column in the output.
struct Part {
  int64_t kind;
  const uint8_t* packed;
  int64_t columns, offset;
};

// y [rows, y_stride] = (rows of `a`) · (the parts' weights, side by side)ᵀ (+ bias [y_stride]), in ONE
// parallel region over every part's tiles (a thread takes a contiguous run of tiles: one stream of weights),
// kGroup tiles of one part at a time: every row through them into a buffer [rows × kGroup · 16], then each row's
// run of columns stored at once. (Tile by tile, each of a prompt piece's rows took 64 bytes of another page of the
// output: at 128 rows a quarter of the gate/up projection's time went to those stores.)
constexpr int64_t kGroup = 8;

void gemm(const std::vector<Part>& parts, const Activations& a, int64_t rows, float* y, int64_t y_stride, const float* bias) {
  std::vector<int64_t> first_tile{0};  // the global index of each part's first tile, then the total
  for (const Part& part : parts) first_tile.push_back(first_tile.back() + (part.columns + kCols - 1) / kCols);
  const int64_t per_tile = a.blocks * tile_bytes(parts[0].kind);
  // about 64 KB of weights per task: enough to amortize the scheduling, small enough to share out
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / per_tile);
#if KQ_AMX
  const bool amx = kernels == Kernels::amx && rows >= kAmxFromRows;
#endif
  at::parallel_for(0, first_tile.back(), grain, [&](int64_t begin, int64_t end) {
    float acc[kRows * kCols];
    std::vector<float> group(rows * kGroup * kCols);  // [rows × tiles · 16]: the outputs of a group of tiles
    size_t p = 0;
    for (int64_t global = begin, tiles; global < end; global += tiles) {
      while (global >= first_tile[p + 1]) ++p;
      const Part& part = parts[p];
      const int64_t tile = global - first_tile[p];
      tiles = std::min({kGroup, end - global, first_tile[p + 1] - global});
      const int64_t ld = tiles * kCols, width = std::min(ld, part.columns - tile * kCols), column = part.offset + tile * kCols;
      for (int64_t i = 0; i < tiles; ++i) {
        const uint8_t* weights = part.packed + (tile + i) * a.blocks * tile_bytes(part.kind);
        float* outputs = group.data() + kCols * i;  // this tile's 16 columns of the group's rows
#if KQ_AMX
        if (amx) {
          dot_tile_amx(part.kind, weights, a, rows, outputs, ld);
          continue;
        }
#endif
        for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
          const int n = int(std::min<int64_t>(kRows, rows - row0));
          dot_tile(part.kind, weights, a, row0, n, acc);
          for (int r = 0; r < n; ++r) std::memcpy(outputs + (row0 + r) * ld, acc + r * kCols, sizeof(float) * kCols);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* from = group.data() + r * ld;
        float* out = y + r * y_stride + column;
        if (bias) for (int64_t c = 0; c < width; ++c) out[c] = from[c] + bias[column + c];
        else std::memcpy(out, from, sizeof(float) * width);
      }
    }
  });
}

}  // namespace

// raw [columns, blocks × raw block bytes] uint8 (a GGUF tensor's rows) -> packed tiles (uint8, 1-D)
at::Tensor repack(int64_t kind, at::Tensor raw) {
  check_kind(kind);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, "repack wants uint8 [columns, bytes]");
  TORCH_CHECK(raw.size(1) % raw_bytes(kind) == 0, "a row of this type is a whole number of ", raw_bytes(kind), "-byte blocks");
  raw = raw.contiguous();
  const int64_t columns = raw.size(0), blocks = raw.size(1) / raw_bytes(kind);
  const int64_t tiles = (columns + kCols - 1) / kCols;
  auto out = at::zeros({tiles * blocks * tile_bytes(kind)}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const uint8_t* rows[kCols];
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t b = 0; b < blocks; ++b) {
        for (int c = 0; c < kCols; ++c) {
          const int64_t column = tile * kCols + c;
          rows[c] = column < columns ? src + column * raw.size(1) + b * raw_bytes(kind) : nullptr;
        }
        repack_block(kind, rows, dst + (tile * blocks + b) * tile_bytes(kind));
      }
  });
  return out;
}

// raw [rows, blocks × raw block bytes] -> float32 [rows, blocks × 256]: the weights as the file means them
at::Tensor dequantize(int64_t kind, at::Tensor raw) {
  check_kind(kind);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, "dequantize wants uint8 [rows, bytes]");
  raw = raw.contiguous();
  const int64_t rows = raw.size(0), blocks = raw.size(1) / raw_bytes(kind);
  auto out = at::empty({rows, blocks * kBlock}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = src + row * raw.size(1) + b * raw_bytes(kind);
        float* y = dst + row * blocks * kBlock + b * kBlock;
        if (kind == Q4_K) {
          const float d = half_to_float(read_u16(block)), dmin = half_to_float(read_u16(block + 2));
          for (int k = 0; k < kBlock; ++k) {
            uint8_t scale, min;
            q4k_scale_min(block + 4, k / 32, scale, min);
            y[k] = d * scale * q4k_value(block + 16, k) - dmin * min;
          }
        } else {
          const float d = half_to_float(read_u16(block + 208));
          for (int k = 0; k < kBlock; ++k)
            y[k] = d * int8_t(block[192 + k / 16]) * (int(q6k_value(block, block + 128, k)) - 32);
        }
      }
  });
  return out;
}

namespace {

// One super-block of activations (256 values at v) as Q8_K: d = absmax / 127, q = round(v · (127 / absmax)) to the
// nearest, ties to even, within ±127, and q's sums over each 16 values. The vector code performs the scalar code's
// float operations on each value (the maximum ignores a NaN as std::max does; a NaN or infinite product lands on −127
// as the clamps order it), so every CPU quantizes to the same bytes.
void quantize_block(const float* v, int8_t* q, float* d, int32_t* sums) {
#if KQ_AVX512
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 most = _mm512_setzero_ps();
  for (int j = 0; j < kBlock; j += 16) most = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(v + j)), most);
  const float amax = _mm512_reduce_max_ps(most);
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  *d = amax / 127.0f;
  const __m512 scale = _mm512_set1_ps(inverse), low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
  for (int j = 0; j < kBlock; j += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(v + j), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i values = _mm512_cvtps_epi32(_mm512_min_ps(high, _mm512_max_ps(rounded, low)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(values));
    sums[j / 16] = _mm512_reduce_add_epi32(values);
  }
#elif KQ_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 most = _mm256_setzero_ps();
  for (int j = 0; j < kBlock; j += 8) most = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)), most);
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  *d = amax / 127.0f;
  const __m256 scale = _mm256_set1_ps(inverse), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  auto quantized = [&](const float* from) {  // 8 values as int32
    const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(from), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(high, _mm256_max_ps(rounded, low)));
  };
  for (int j = 0; j < kBlock; j += 16) {
    const __m256i first = quantized(v + j), second = quantized(v + j + 8);
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(first, second), 0xd8);  // 16 int16 in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
    __m256i total = _mm256_add_epi32(first, second);
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4e));
    sums[j / 16] = _mm_cvtsi128_si32(_mm_add_epi32(four, _mm_shuffle_epi32(four, 0xb1)));
  }
#else
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  *d = amax / 127.0f;
  for (int j = 0; j < kBlock; ++j) q[j] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(v[j] * inverse))));
  for (int s = 0; s < 16; ++s) {
    int32_t total = 0;
    for (int j = 0; j < 16; ++j) total += q[16 * s + j];
    sums[s] = total;
  }
#endif
}

// x [rows, K] float32 -> (q int8 [rows, P], d float32 [rows, P / 256], sums int32 [rows, P / 16], pair sums int16
// [rows, P / 32]) for P = K rounded up to whole super-blocks: the values past K are zeros (a padded layer's)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_padded(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_rows wants float32 [rows, K]");
  x = x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1), k = (width + kBlock - 1) / kBlock * kBlock, blocks = k / kBlock;
  auto q = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto d = at::empty({rows, blocks}, x.options());
  auto sums = at::empty({rows, k / 16}, x.options().dtype(at::kInt));
  auto pair_sums = at::empty({rows, k / 32}, x.options().dtype(at::kShort));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = sums.data_ptr<int32_t>();
  int16_t* pp = pair_sums.data_ptr<int16_t>();
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {  // a decode step's row: one thread
    float padded[kBlock];  // a super-block that runs past K: its values, then zeros (exact zeros in every sum)
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / blocks, first = (i % blocks) * kBlock, present = std::min<int64_t>(kBlock, width - first);
      const float* v = xp + row * width + first;
      if (present < kBlock) {
        std::copy(v, v + present, padded);
        std::fill(padded + present, padded + kBlock, 0.0f);
        v = padded;
      }
      quantize_block(v, qp + i * kBlock, dp + i, sp + i * 16);
      for (int s = 0; s < 8; ++s) pp[i * 8 + s] = int16_t(sp[i * 16 + 2 * s] + sp[i * 16 + 2 * s + 1]);  // |sum| ≤ 32 · 127
    }
  });
  return {q, d, sums, pair_sums};
}

}  // namespace

// x [rows, K] float32 (K a multiple of 256) -> (q int8 [rows, K], d float32 [rows, K / 256],
// sums int32 [rows, K / 16], pair sums int16 [rows, K / 32])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "kquant layers need an input width that is a multiple of 256, not ",
              x.dim() == 2 ? x.size(1) : -1);
  return quantize_padded(x);
}

// x [rows, K] float32 -> y [rows, Σ columns]: the parts' outputs side by side (plus bias [Σ columns]).
// parts: packed tiles, one per GGUF tensor of the layer (e.g. q, k and v), with their kinds and columns.
// A K that is not a multiple of 256 takes weights whose rows were padded with zeros to whole super-blocks
// (`models/requantize.py`): x is quantized as if padded with zeros too (`quantize_padded`): exact zeros in every sum.
at::Tensor linear(at::Tensor x, std::vector<at::Tensor> packed, std::vector<int64_t> kinds,
                  std::vector<int64_t> columns, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(packed.size() == kinds.size() && kinds.size() == columns.size() && !packed.empty(), "linear: one kind and width per part");
  TORCH_CHECK(x.dim() == 2, "linear wants x [rows, K]");
  auto [q, d, sums, pair_sums] = quantize_padded(x);  // weights padded with zeros to whole super-blocks: x too
  const int64_t rows = x.size(0), k = q.size(1);
  int64_t total = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    check_kind(kinds[i]);
    const int64_t tiles = (columns[i] + kCols - 1) / kCols;
    TORCH_CHECK(packed[i].numel() == tiles * (k / kBlock) * tile_bytes(kinds[i]),
                "linear: part ", i, " was packed for another input width");
    total += columns[i];
  }
  auto y = at::empty({rows, total}, x.options());
  const Activations a{q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<int32_t>(), pair_sums.data_ptr<int16_t>(),
                      k, k / kBlock, skip_padding ? x.size(1) : k};
  std::vector<Part> parts;
  for (size_t i = 0, offset = 0; i < packed.size(); offset += columns[i], ++i)
    parts.push_back({kinds[i], packed[i].data_ptr<uint8_t>(), columns[i], int64_t(offset)});
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == total, "linear: the bias has ", b.numel(), " values for ", total, " outputs");
  }
  gemm(parts, a, rows, y.data_ptr<float>(), total, bias.has_value() ? b.data_ptr<float>() : nullptr);
  return y;
}

namespace {

struct Linear {  // a `KQuantLinear`: its parts and bias
  std::vector<at::Tensor> packed;
  std::vector<int64_t> kinds, columns;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const { return linear(x, packed, kinds, columns, bias); }
};

Linear to_linear(const py::tuple& t) {  // (packed parts, kinds, columns, bias or None)
  Linear l{t[0].cast<std::vector<at::Tensor>>(), t[1].cast<std::vector<int64_t>>(), t[2].cast<std::vector<int64_t>>(), c10::nullopt};
  if (!t[3].is_none()) l.bias = t[3].cast<at::Tensor>();
  return l;
}

}  // namespace

// The decoder stack's attention: the exact attention of `attention.h` (chains and token trees).
struct ExactAttention {
  at::Tensor operator()(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                        const c10::optional<at::Tensor>& mask, double scale) const {
    return exact_attention::attend(q, keys, values, start, mask, scale);
  }
};

// One decoder layer of a kquant `Transformer` (`decoder.h`) from the Python layer's tuple
// (input_norm, post_norm, qkv, o, gate_up, down), each linear as `to_linear` reads it.
DecoderLayer<Linear> kquant_layer(const py::tuple& t) {
  return {t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(), to_linear(t[2]), to_linear(t[3]), to_linear(t[4]), to_linear(t[5])};
}

// The kernels built here, fastest first ("amx": AMX tiles from 9 rows, else AVX-512 VNNI; "avx512": AVX-512
// VNNI, "avx2": AVX2 with FMA and F16C, "portable": plain C++); they give the same bits.
std::vector<std::string> kernels_built() {
  std::vector<std::string> names;
  if (amx_usable()) names.push_back("amx");
  if (KQ_AVX512) names.push_back("avx512");
  if (KQ_AVX2) names.push_back("avx2");
  names.push_back("portable");
  return names;
}

// Run `name`'s code (tiles and attention) from now on; returns it. The tests and probes compare them.
std::string use_kernels(const std::string& name) {
  const auto built = kernels_built();
  TORCH_CHECK(std::find(built.begin(), built.end(), name) != built.end(), "kquant kernels '", name, "' are not built here");
  kernels = name == "amx" ? Kernels::amx : name == "avx512" ? Kernels::avx512 : name == "avx2" ? Kernels::avx2 : Kernels::portable;
  exact_attention::vectors = name == "amx" || name == "avx512" ? exact_attention::Vectors::avx512
                             : name == "avx2" ? exact_attention::Vectors::avx2 : exact_attention::Vectors::none;
  return name;
}

// Prefetch the weight stream for one and two rows too (the AVX-512 code always does from 3 rows for Q4_K, 2 for Q6_K, 1
// for Q6_K on AMX builds; the AVX2 code only under this); returns the setting. The same bits either way: prefetching
// moves no value.
bool set_prefetch_few_rows(bool on) {
  prefetch_few_rows = on;
  return prefetch_few_rows;
}

std::string kernels_in_use() {
  return kernels == Kernels::amx ? "amx" : kernels == Kernels::avx512 ? "avx512" : kernels == Kernels::avx2 ? "avx2" : "portable";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack", &repack, "raw GGUF blocks [columns, bytes] -> tiles of 16 columns");
  m.def("dequantize", &dequantize, "raw GGUF blocks [rows, bytes] -> float32 weights");
  m.def("quantize_rows", &quantize_rows, "float32 [rows, K] -> (int8 values, scales per 256, sums per 16 and per 32)");
  m.def("linear", &linear, "x [rows, K] -> [rows, Σ columns] through k-quant weights");
  m.def("kernels_built", &kernels_built, "the kernels built here, fastest first (amx, avx512, avx2, portable)");
  m.def("use_kernels", &use_kernels, "run these kernels from now on (one of kernels_built())");
  m.def("kernels_in_use", &kernels_in_use, "the kernels that run");
  m.def("set_prefetch_few_rows", &set_prefetch_few_rows, "prefetch the weight stream for one and two rows too", py::arg("on"));
  m.def("prefetch_few_rows", [] { return prefetch_few_rows; }, "whether the vector code prefetches for one and two rows");
  m.def("set_skip_padding", [](bool on) { return skip_padding = on; }, "skip a padded layer's sub-blocks past its input",
        py::arg("on"));
  m.def("skip_padding", [] { return skip_padding; }, "whether the kernels skip a padded layer's sub-blocks past its input");
  m.def("attend", &exact_attention::attend, "q [heads, n, d] over one layer's cache [kv_heads, capacity, d] from slot `start` "
        "(mask: None for a chain, else bool [n, start + n]) -> [heads, n, d], each position on its own",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("start"), py::arg("mask"), py::arg("scale"));
  bind_decoder_layers<Linear, ExactAttention>(m, "KQuantLayers", kquant_layer);
}
