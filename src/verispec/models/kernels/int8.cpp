// The int8 path's CPU work outside fbgemm's matmuls, in C++ (see `models/kernels/__init__.py`).
//
// `split_rows` / `join_rows`: the elementwise work around verispec's int8 linear layer
// (`models/int8.py`), fused: one call before fbgemm's integer matmul and one after, instead of about
// fifteen small torch operations per linear layer (benchmarks/probes/int8_overhead.py measures the gain).
// They compute exactly what the torch code in `Int8Linear` computes, operation by operation and in
// float32 (built with -ffp-contract=off, so no multiply-add is fused).
//
// `Int8Layers`: a whole int8 decoder stack for one chain of up to 32 new positions (decoding and
// verification), calling the same ATen operations in the same order as `Transformer._layers`, so a model
// gives the same bits with or without this extension, without the Python interpreter in between.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/api/object.h>

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

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

}  // namespace

// The decoder layers of an int8 `Transformer` for one chain of n ≤ 32 new positions, as one C++ call:
// the same ATen operations, in the same order, as `Transformer._layers` and `_attend_rows` (so the same
// bits), without the Python interpreter between them.
class Int8Layers {
 public:
  Int8Layers(const std::vector<py::tuple>& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(1.0 / std::sqrt(double(head_dim))) {
    for (const auto& t : layers) {  // (input_norm, post_norm, qkv packed, qkv bias, o packed, o bias, gate_up packed, down packed)
      auto linear = [&](int packed, int bias) {
        Linear l{c10::IValue(t[packed].cast<torch::jit::Object>()._ivalue()), c10::nullopt};
        if (bias >= 0 && !t[bias].is_none()) l.bias = t[bias].cast<at::Tensor>();
        return l;
      };
      layers_.push_back({t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(), linear(2, 3), linear(4, 5), linear(6, -1), linear(7, -1)});
    }
  }

  // x [n, hidden] -> [n, hidden]; writes the new keys/values to slots start … start+n−1 of every layer.
  at::Tensor forward(at::Tensor x, at::Tensor keys, at::Tensor values, int64_t start, at::Tensor cos, at::Tensor sin) const {
    const int64_t n = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor qkv = layer.qkv(rms_norm(x, layer.input_norm));
      at::Tensor q = qkv.slice(1, 0, q_size).view({n, heads_, head_dim_}).transpose(0, 1);
      at::Tensor k = qkv.slice(1, q_size, q_size + kv_size).view({n, kv_heads_, head_dim_}).transpose(0, 1);
      at::Tensor v = qkv.slice(1, q_size + kv_size).view({n, kv_heads_, head_dim_}).transpose(0, 1);
      q = rotate(q, cos, sin);
      k = rotate(k, cos, sin);
      at::Tensor attn = attend(keys.select(0, i), values.select(0, i), q, k, v, start);
      x = x + layer.o(attn.transpose(0, 1).reshape({n, q_size}));
      auto halves = layer.gate_up(rms_norm(x, layer.post_norm)).chunk(2, -1);
      x = x + layer.down(at::silu(halves[0]) * halves[1]);
    }
    return x;
  }

 private:
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
    return (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps_)) * weight;
  }

  static at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t half = x.size(-1) / 2;
    at::Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
    return x * cos + rotated * sin;
  }

  // keys/values [kv_heads, capacity, head_dim] of one layer; q [heads, n, hd], k/v [kv_heads, n, hd].
  at::Tensor attend(at::Tensor keys, at::Tensor values, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, int64_t start) const {
    const int64_t n = q.size(1), end = start + n;
    keys.slice(1, start, end).copy_(k);
    values.slice(1, start, end).copy_(v);
    auto one = [&](int64_t position, int64_t seen) {  // one query over the first `seen` slots
      return at::scaled_dot_product_attention(q.unsqueeze(0).slice(2, position, position + 1),
                                              keys.slice(1, 0, seen).unsqueeze(0), values.slice(1, 0, seen).unsqueeze(0),
                                              c10::nullopt, 0.0, false, scale_, true).select(0, 0);
    };
    if (n == 1) return one(0, end);
    std::vector<at::Tensor> outputs;
    for (int64_t j = 0; j < n; ++j) outputs.push_back(one(j, start + j + 1));
    return at::cat(outputs, 1);
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_rows", &split_rows, "per-row 7-bit coarse (and fine) activation levels and absmax");
  m.def("join_rows", &join_rows, "integer sums back to float rows, scaled, plus bias");
  py::class_<Int8Layers>(m, "Int8Layers")
      .def(py::init<const std::vector<py::tuple>&, int64_t, int64_t, int64_t, double>())
      .def("forward", &Int8Layers::forward, py::call_guard<py::gil_scoped_release>());
}
