// The int8 path's CPU work outside fbgemm's matmuls, in C++ (see `models/kernels/__init__.py`).
//
// `split_rows` / `join_rows`: the elementwise work around verispec's int8 linear layer
// (`models/int8.py`), fused: one call before fbgemm's integer matmul and one after, instead of about
// fifteen small torch operations per linear layer (benchmarks/probes/int8_overhead.py measures the gain).
// They compute exactly what the torch code in `Int8Linear` computes, operation by operation and in
// float32 (built with -ffp-contract=off, so no multiply-add is fused).
//
// `Int8Layers`: the whole decoder stack (`decoder.h`) on these int8 linear layers, for one chain of up to
// 32 new positions (decoding and verification): the same bits as `Transformer._layers`, in one call.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/api/object.h>

#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr float kLevels = 63.0f;     // ACT_LEVELS
constexpr float kResidual = 126.0f;  // RESIDUAL_LEVELS

}  // namespace

// x [M, K] -> (q [2M, K] (coarse rows, then fine rows; or [M, K] without the residual), absmax [M, 1]):
//   absmax = max(max_k |x|, 1e-30), scaled = x / absmax · 63, coarse = round(scaled),
//   fine = round((scaled − coarse) · 126), rounding half to even like torch.round.
std::tuple<torch::Tensor, torch::Tensor> split_rows(torch::Tensor x, bool residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "split_rows wants float32 [rows, in]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({residual ? 2 * M : M, K}, x.options());
  auto absmax = torch::empty({M, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* ap = absmax.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * K;
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      amax = std::max(amax, 1e-30f);
      ap[m] = amax;
      float* coarse = qp + m * K;
      float* fine = qp + (M + m) * K;
      for (int64_t k = 0; k < K; ++k) {
        const float scaled = row[k] / amax * kLevels;
        const float c = std::nearbyint(scaled);
        coarse[k] = c;
        if (residual) fine[k] = std::nearbyint((scaled - c) * kResidual);
      }
    }
  });
  return {q, absmax};
}

// acc [2M, N] (or [M, N]) integer sums from fbgemm, absmax [M, 1], bias [N] or None -> y [M, N]:
//   y = (acc[:M] + acc[M:] / 126) · (absmax / 63) + bias
torch::Tensor join_rows(torch::Tensor acc, torch::Tensor absmax, c10::optional<torch::Tensor> bias, bool residual) {
  acc = acc.contiguous();
  const int64_t M = absmax.size(0), N = acc.size(1);
  TORCH_CHECK(acc.size(0) == (residual ? 2 * M : M), "join_rows: acc and absmax rows do not match");
  auto y = torch::empty({M, N}, acc.options());
  const float* accp = acc.data_ptr<float>();
  const float* ap = absmax.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M * N, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / N, n = i % N;
      const float scale = ap[m] / kLevels;
      float v = accp[i];
      if (residual) v = v + accp[(M + m) * N + n] / kResidual;
      v = v * scale;
      yp[i] = bp ? v + bp[n] : v;
    }
  });
  return y;
}


namespace {

// fbgemm's integer matmul (the op `Int8Linear._integer_matmul` calls): integer-valued rows q, scale 1,
// zero point 64, prepacked int8 weights -> exact int32 sums times the weight scales, as float32.
at::Tensor fbgemm_matmul(const at::Tensor& q, const c10::IValue& packed) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "quantized::linear_with_input_q_dq_qweight_dq_output_fp32", "");
  torch::jit::Stack stack{q, 1.0, static_cast<int64_t>(64), packed};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct Linear {
  c10::IValue packed;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {  // Int8Linear.__call__ with the residual row
    auto [q, absmax] = split_rows(x, true);
    return join_rows(fbgemm_matmul(q, packed), absmax, bias, true);
  }
};

}  // namespace

// One decoder layer of an int8 `Transformer` (`decoder.h`) from the Python layer's tuple
// (input_norm, post_norm, qkv packed, qkv bias, o packed, o bias, gate_up packed, down packed).
DecoderLayer<Linear> int8_layer(const py::tuple& t) {
  auto linear = [&](int packed, int bias) {
    Linear l{c10::IValue(t[packed].cast<torch::jit::Object>()._ivalue()), c10::nullopt};
    if (bias >= 0 && !t[bias].is_none()) l.bias = t[bias].cast<at::Tensor>();
    return l;
  };
  return {t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(), linear(2, 3), linear(4, 5), linear(6, -1), linear(7, -1)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_rows", &split_rows, "per-row 7-bit coarse (and fine) activation levels and absmax");
  m.def("join_rows", &join_rows, "integer sums back to float rows, scaled, plus bias");
  bind_decoder_layers<Linear>(m, "Int8Layers", int8_layer);
}
