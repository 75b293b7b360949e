// A candidate kernel measured for issue #8 and NOT used by verispec (benchmarks/probes/kquant_probe.py runs it):
// AVX2 matrix products with llama.cpp's K-quant weights (Q4_K, Q6_K).
//
// y[m, n] = Σ_k x[m, k] · W[n, k], with W exactly the GGUF file's quantized values and x quantized
// on the fly to int8 with one scale per row and group of 32 (`quantize_rows`). Every output element
// is computed by the same sequence of operations whatever the number of rows M in the call, so a
// row's result does not depend on the other rows: verifying γ+1 draft positions in one call gives
// bit-for-bit what decoding them one at a time gives. The weights are read once per call for all
// rows (up to 4 rows share each unpacked group), meant to keep a few rows nearly as cheap as one;
// measured, it does not: 4-bit unpacking makes it compute-bound on 2 AVX2 cores (docs/history.md, 2026-11-23).
//
// Weight layouts (the same numbers as the GGUF file's blocks of 256, unpacked):
//   q4k: qs [N, K/2] uint8, per group of 32 elements 16 bytes, byte j = element j (low nibble) and
//        element j + 16 (high nibble); sc, mn [N, K/32] uint8 (6-bit); d, dmin [N, K/256] float:
//        W = d·sc·q − dmin·mn
//   q6k: q [N, K] int8 in [−32, 31]; sc [N, K/16] int8; d [N, K/256] float: W = d·sc·q
// Built with -ffp-contract=off, so the compiler fuses nothing the source does not fuse.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <tuple>

namespace {

constexpr int kGroup = 32;
constexpr int kBlock = 256;
constexpr int kRowsPerPass = 4;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 u8x8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 s8x8_to_float(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

struct Activations {
  const int8_t* q;    // [M, K]
  const float* scale; // [M, K/32]
  const float* qsum;  // [M, K/32]: scale · Σ q over the group (the Q4_K minimum's factor)
  int64_t K;
};

// Rows m0 … m0+R−1 of y[:, n] for one Q4_K weight row.
template <int R>
inline void q4k_rows(const Activations& a, int64_t m0, const uint8_t* qs, const uint8_t* sc,
                     const uint8_t* mn, const float* d, const float* dmin, float* out[R]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  alignas(32) float scale[R][8];
  const int64_t groups = a.K / kGroup;
  for (int64_t b = 0; b < a.K / kBlock; ++b) {
    const __m256 s8 = _mm256_mul_ps(_mm256_set1_ps(d[b]), u8x8_to_float(sc + 8 * b));
    const __m256 m8 = _mm256_mul_ps(_mm256_set1_ps(dmin[b]), u8x8_to_float(mn + 8 * b));
    for (int r = 0; r < R; ++r) {
      const int64_t row = (m0 + r) * groups + 8 * b;
      _mm256_store_ps(scale[r], _mm256_mul_ps(s8, _mm256_loadu_ps(a.scale + row)));
      macc[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a.qsum + row), macc[r]);
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t g = 8 * b + j;
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * g));
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + r) * a.K + kGroup * g));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  // 8 × int32
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[r][j]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) *out[r] = hsum(acc[r]) - hsum(macc[r]);
}

// Rows m0 … m0+R−1 of y[:, n] for one Q6_K weight row.
template <int R>
inline void q6k_rows(const Activations& a, int64_t m0, const int8_t* q, const int8_t* sc, const float* d,
                     float* out[R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  alignas(32) float sub[16];
  const int64_t groups = a.K / kGroup;
  for (int64_t b = 0; b < a.K / kBlock; ++b) {
    const __m256 db = _mm256_set1_ps(d[b]);
    _mm256_store_ps(sub, _mm256_mul_ps(db, s8x8_to_float(sc + 16 * b)));
    _mm256_store_ps(sub + 8, _mm256_mul_ps(db, s8x8_to_float(sc + 16 * b + 8)));
    for (int j = 0; j < 8; ++j) {
      const int64_t g = 8 * b + j;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kGroup * g));
      const __m256i w_abs = _mm256_sign_epi8(w, w);
      const __m256 halves = _mm256_set_m128(_mm_broadcast_ss(&sub[2 * j + 1]), _mm_broadcast_ss(&sub[2 * j]));
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + r) * a.K + kGroup * g));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)), ones);
        const __m256 s = _mm256_mul_ps(halves, _mm256_broadcast_ss(a.scale + (m0 + r) * groups + g));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) *out[r] = hsum(acc[r]);
}

// Calls rows<R>(m0, out) over all M rows in passes of up to 4.
template <typename Rows>
inline void each_pass(int64_t M, float* y_n, int64_t N, Rows rows) {
  int64_t m0 = 0;
  for (; m0 + kRowsPerPass <= M; m0 += kRowsPerPass) {
    float* out[4] = {y_n + m0 * N, y_n + (m0 + 1) * N, y_n + (m0 + 2) * N, y_n + (m0 + 3) * N};
    rows(std::integral_constant<int, 4>{}, m0, out);
  }
  float* out[3] = {y_n + m0 * N, y_n + (m0 + 1) * N, y_n + (m0 + 2) * N};
  switch (M - m0) {
    case 3: rows(std::integral_constant<int, 3>{}, m0, out); break;
    case 2: rows(std::integral_constant<int, 2>{}, m0, out); break;
    case 1: rows(std::integral_constant<int, 1>{}, m0, out); break;
    default: break;
  }
}

Activations view(const torch::Tensor& xq, const torch::Tensor& scale, const torch::Tensor& qsum) {
  return {xq.data_ptr<int8_t>(), scale.data_ptr<float>(), qsum.data_ptr<float>(), xq.size(1)};
}

}  // namespace

// x [M, K] float32 -> (q [M, K] int8, scale [M, K/32], qsum [M, K/32]): per group of 32,
// scale = absmax / 127, q = round-half-even(x / scale), qsum = scale · Σ q.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % kGroup == 0,
              "quantize_rows wants float32 [M, K] with K a multiple of 32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = M * (K / kGroup);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M, K / kGroup}, x.options());
  auto qsum = torch::empty({M, K / kGroup}, x.options());
  const float* xs = x.data_ptr<float>();
  int8_t* qs = q.data_ptr<int8_t>();
  float* ss = scale.data_ptr<float>();
  float* sums = qsum.data_ptr<float>();
  at::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* v = xs + kGroup * g;
      float amax = 0.0f;
      for (int k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float s = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int total = 0;
      for (int k = 0; k < kGroup; ++k) {
        const int value = static_cast<int>(std::nearbyint(v[k] * inv));
        qs[kGroup * g + k] = static_cast<int8_t>(value);
        total += value;
      }
      ss[g] = s;
      sums[g] = s * static_cast<float>(total);
    }
  });
  return {q, scale, qsum};
}

torch::Tensor q4k_matmul(torch::Tensor xq, torch::Tensor scale, torch::Tensor qsum, torch::Tensor qs,
                         torch::Tensor sc, torch::Tensor mn, torch::Tensor d, torch::Tensor dmin) {
  const int64_t M = xq.size(0), K = xq.size(1), N = qs.size(0);
  TORCH_CHECK(K % kBlock == 0 && qs.size(1) == K / 2, "q4k_matmul: shapes do not match");
  auto y = torch::empty({M, N}, scale.options());
  const Activations a = view(xq, scale, qsum);
  const uint8_t *qp = qs.data_ptr<uint8_t>(), *scp = sc.data_ptr<uint8_t>(), *mnp = mn.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *dmp = dmin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      each_pass(M, yp + n, N, [&](auto R, int64_t m0, float** out) {
        q4k_rows<decltype(R)::value>(a, m0, qp + n * (K / 2), scp + n * (K / kGroup), mnp + n * (K / kGroup),
                                     dp + n * (K / kBlock), dmp + n * (K / kBlock), out);
      });
    }
  });
  return y;
}

torch::Tensor q6k_matmul(torch::Tensor xq, torch::Tensor scale, torch::Tensor qsum, torch::Tensor q,
                         torch::Tensor sc, torch::Tensor d) {
  const int64_t M = xq.size(0), K = xq.size(1), N = q.size(0);
  TORCH_CHECK(K % kBlock == 0 && q.size(1) == K, "q6k_matmul: shapes do not match");
  auto y = torch::empty({M, N}, scale.options());
  const Activations a = view(xq, scale, qsum);
  const int8_t *qp = q.data_ptr<int8_t>(), *scp = sc.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      each_pass(M, yp + n, N, [&](auto R, int64_t m0, float** out) {
        q6k_rows<decltype(R)::value>(a, m0, qp + n * K, scp + n * (K / 16), dp + n * (K / kBlock), out);
      });
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "x [M, K] -> int8 per group of 32, scales, scaled sums");
  m.def("q4k_matmul", &q4k_matmul, "quantized x times Q4_K weights");
  m.def("q6k_matmul", &q6k_matmul, "quantized x times Q6_K weights");
}
