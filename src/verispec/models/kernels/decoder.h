// The decoder stack of verispec's runner as one C++ call, shared by the quantized precisions' extensions
// (`int8.cpp`, `kquant.cpp`), each with its own linear layer.
//
// `DecoderLayers<Linear, Attention>::forward` runs one row of n ≤ 32 new positions (decoding and
// verification: a chain, or a token tree where `Attention` takes a mask) through every layer with the
// same operations, in the same order, as `Transformer._layers` and `_attend_rows` (so the same bits),
// without the Python interpreter between them. `Linear` is any type with
// `at::Tensor operator()(const at::Tensor& x) const` (x [n, in] -> [n, out]); `Attention` attends the
// new positions over the cache they were just stored in (`SdpaAttention` by default: chains only).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <vector>

template <typename Linear>
struct DecoderLayer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

// Each position on its own through `scaled_dot_product_attention` (what `_attend_rows` does for a runner
// without its own attention): q [heads, n, hd], keys/values [kv_heads, capacity, hd] -> [heads, n, hd].
struct SdpaAttention {
  at::Tensor operator()(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                        const c10::optional<at::Tensor>& mask, double scale) const {
    TORCH_CHECK(!mask.has_value(), "this decoder stack runs chains only (token trees take the Python loop)");
    const int64_t n = q.size(1);
    auto one = [&](int64_t position, int64_t seen) {  // one query over the first `seen` slots
      return at::scaled_dot_product_attention(q.unsqueeze(0).slice(2, position, position + 1),
                                              keys.slice(1, 0, seen).unsqueeze(0), values.slice(1, 0, seen).unsqueeze(0),
                                              c10::nullopt, 0.0, false, scale, true).select(0, 0);
    };
    if (n == 1) return one(0, start + 1);
    std::vector<at::Tensor> outputs;
    for (int64_t j = 0; j < n; ++j) outputs.push_back(one(j, start + j + 1));
    return at::cat(outputs, 1);
  }
};

template <typename Linear, typename Attention = SdpaAttention>
class DecoderLayers {
 public:
  DecoderLayers(std::vector<DecoderLayer<Linear>> layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : layers_(std::move(layers)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(1.0 / std::sqrt(double(head_dim))) {}

  // x [n, hidden] -> [n, hidden]; writes the new keys/values to slots start … start+n−1 of every layer.
  // mask: none for a chain, else bool [n, start + n] (a token tree: what each node sees).
  at::Tensor forward(at::Tensor x, at::Tensor keys, at::Tensor values, int64_t start, at::Tensor cos, at::Tensor sin,
                     c10::optional<at::Tensor> mask) const {
    const int64_t n = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer<Linear>& layer = layers_[i];
      at::Tensor qkv = layer.qkv(rms_norm(x, layer.input_norm));
      at::Tensor q = qkv.slice(1, 0, q_size).view({n, heads_, head_dim_}).transpose(0, 1);
      at::Tensor k = qkv.slice(1, q_size, q_size + kv_size).view({n, kv_heads_, head_dim_}).transpose(0, 1);
      at::Tensor v = qkv.slice(1, q_size + kv_size).view({n, kv_heads_, head_dim_}).transpose(0, 1);
      q = rotate(q, cos, sin);
      k = rotate(k, cos, sin);
      at::Tensor attn = attend(keys.select(0, i), values.select(0, i), q, k, v, start, mask);
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
                    const at::Tensor& v, int64_t start, const c10::optional<at::Tensor>& mask) const {
    keys.slice(1, start, start + q.size(1)).copy_(k);
    values.slice(1, start, start + q.size(1)).copy_(v);
    return attention_(q, keys, values, start, mask, scale_);
  }

  std::vector<DecoderLayer<Linear>> layers_;
  Attention attention_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

// How many threads `at::parallel_for` gives this extension's loops (each of `items` takes a while, so
// every thread gets some): 1 when it was built without OpenMP, where the header runs the loop serially.
inline int64_t parallel_threads(int64_t items) {
  std::vector<std::atomic<int>> seen(at::get_num_threads());
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    volatile double spin = 0;
    for (int64_t i = begin; i < end; ++i)
      for (int k = 0; k < 200000; ++k) spin = spin + 1;
    seen[at::get_thread_num()] = 1;
  });
  int64_t threads = 0;
  for (const auto& s : seen) threads += s.load();
  return threads;
}

// Registers `DecoderLayers<Linear>` as the Python class `name`: built from the Python layers' tuples, each
// read by `read` (py::tuple -> DecoderLayer<Linear>), and the shape (heads, kv_heads, head_dim, eps);
// `forward` releases the GIL.
template <typename Linear, typename Attention = SdpaAttention, typename Read>
void bind_decoder_layers(py::module& m, const char* name, Read read) {
  using Layers = DecoderLayers<Linear, Attention>;
  py::class_<Layers>(m, name)
      .def(py::init([read](const std::vector<py::tuple>& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) {
        std::vector<DecoderLayer<Linear>> read_layers;
        for (const auto& layer : layers) read_layers.push_back(read(layer));
        return Layers(std::move(read_layers), heads, kv_heads, head_dim, eps);
      }))
      .def("forward", &Layers::forward, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("keys"),
           py::arg("values"), py::arg("start"), py::arg("cos"), py::arg("sin"), py::arg("mask") = py::none());
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses for `items` long tasks", py::arg("items"));
}
