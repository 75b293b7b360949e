// The decoder stack of verispec's runner as one C++ call, shared by the quantized precisions' extensions
// (`int8.cpp`, `kquant.cpp`), each with its own linear layer.
//
// `DecoderLayers<Linear, Attention>::forward` runs rows of new positions (decoding and verification: a chain,
// or a token tree where `Attention` takes a mask; kquant's prompt pieces too; a server's batch: several rows,
// each on its own cache) through every layer with the same operations, in the same order, as
// `Transformer._layers` and `_attend_rows` (so the same bits), without the Python interpreter between them.
// The linear layers take every row's positions at once ([Σn, in]: the weights read once for the batch); each
// row stores its keys and values and attends on its own cache. `Linear` is any type with
// `at::Tensor operator()(const at::Tensor& x) const` (x [n, in] -> [n, out]), computing each row on its own;
// `Attention` attends a row's new positions over the cache they were just stored in (`SdpaAttention` by
// default: chains only).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor casters, without the C++ frontend

#include <atomic>
#include <cmath>
#include <cstring>
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
        scale_(1.0 / std::sqrt(double(head_dim))) {
    for (DecoderLayer<Linear>& layer : layers_) {  // what `rms_norm` reads directly
      layer.input_norm = layer.input_norm.to(at::kFloat).contiguous();
      layer.post_norm = layer.post_norm.to(at::kFloat).contiguous();
    }
  }

  // x [N, hidden] (the rows' new positions, concatenated) -> [N, hidden]. Row r holds counts[r] positions; it
  // writes its keys/values to slots starts[r] … starts[r]+counts[r]−1 of every layer of keys[r]/values[r]
  // [layers, kv_heads, capacity, hd]; masks[r]: none for a chain, else bool [counts[r], starts[r] + counts[r]] (a
  // token tree: what each node sees). cos/sin [1, N, hd] at the rows' positions. Everything is float32.
  at::Tensor forward(at::Tensor x, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, at::Tensor cos, at::Tensor sin,
                     const std::vector<c10::optional<at::Tensor>>& masks) const {
    const size_t rows = counts.size();
    TORCH_CHECK(rows > 0 && keys.size() == rows && values.size() == rows && starts.size() == rows && masks.size() == rows,
                "the decoder stack takes one cache, start, count and mask per row");
    TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                "the decoder stack runs float32 activations and rotary tables");
    int64_t total = 0;
    for (size_t r = 0; r < rows; ++r) {
      TORCH_CHECK(keys[r].scalar_type() == at::kFloat && values[r].scalar_type() == at::kFloat, "the decoder stack runs float32 caches");
      TORCH_CHECK(keys[r].stride(-1) == 1 && values[r].stride(-1) == 1, "the decoder stack wants caches contiguous per head row");
      TORCH_CHECK(counts[r] > 0 && starts[r] >= 0 && starts[r] + counts[r] <= keys[r].size(2), "a row does not fit its cache");
      total += counts[r];
    }
    TORCH_CHECK(x.size(0) == total && cos.size(1) == total && sin.size(1) == total, "x, cos and sin hold every row's positions");
    const int64_t q_size = heads_ * head_dim_;
    x = x.contiguous();
    cos = cos.contiguous();  // [1, N, head_dim]
    sin = sin.contiguous();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer<Linear>& layer = layers_[i];
      at::Tensor qkv = layer.qkv(rms_norm(x, layer.input_norm)).contiguous();  // [N, q_size + 2 kv_size]
      std::vector<at::Tensor> attended;  // per row [n, q_size]
      for (size_t r = 0, offset = 0; r < rows; offset += counts[r], ++r) {
        at::Tensor layer_keys = keys[r].select(0, i), layer_values = values[r].select(0, i);  // [kv_heads, capacity, hd]
        at::Tensor q = rotate_and_store(qkv, offset, counts[r], layer_keys, layer_values, starts[r], cos, sin);  // [heads, n, hd]
        at::Tensor attn = attention_(q, layer_keys, layer_values, starts[r], masks[r], scale_);  // [heads, n, hd]
        attended.push_back(attn.transpose(0, 1).reshape({counts[r], q_size}));
      }
      x = add(x, layer.o(rows == 1 ? attended[0] : at::cat(attended)));
      x = add(x, layer.down(silu_times(layer.gate_up(rms_norm(x, layer.post_norm)))));
    }
    return x;
  }

 private:
  // The element-wise work is written out here rather than left to one ATen call per operation (about 30 a
  // layer, each a dispatch and an allocation). Each loop performs `Transformer._layers`'s float operations
  // on each element in the same order (every product and sum rounded on its own: the extensions build with
  // -ffp-contract=off), so the bits are the same; the reductions and transcendental functions (the mean of
  // squares, SiLU) stay torch's own. A pass of many rows (a prompt's piece) shares its rows out over the
  // threads (`each_row`); a decode step's few rows stay on the calling thread.

  // f(r) for every row r < rows: up to kRowsPerTask rows (a decode step, a verification) on the calling
  // thread, more in tasks of at least that many over the threads (each row on its own: the same bits)
  static constexpr int64_t kRowsPerTask = 32;
  template <typename F>
  static void each_row(int64_t rows, const F& f) {
    if (rows <= kRowsPerTask) {
      for (int64_t r = 0; r < rows; ++r) f(r);
      return;
    }
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) f(r);
    });
  }

  // x [n, h] -> (x · (1 / √(mean(x²) + eps))) · weight [h] (float32, contiguous), each row on its own
  // (`Transformer._rms_norm`)
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
    const at::Tensor mean = x.pow(2).mean({-1}, true).contiguous();  // [n, 1]: torch's reduction, its summation order
    at::Tensor out = at::empty_like(x);
    const int64_t rows = x.size(0), width = x.size(1);
    const float eps = float(eps_);  // what adding a Python float to a float32 tensor adds
    const float *xp = x.data_ptr<float>(), *mp = mean.data_ptr<float>(), *wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    each_row(rows, [&](int64_t r) {
      const float inverse = 1.0f / std::sqrt(mp[r] + eps);  // torch's rsqrt: a rounded square root, a rounded division
      for (int64_t d = 0; d < width; ++d) op[r * width + d] = (xp[r * width + d] * inverse) * wp[d];
    });
    return out;
  }

  // x [n, h] + y [n, h], written over y (a linear layer's fresh output)
  static at::Tensor add(const at::Tensor& x, at::Tensor y) {
    y = y.contiguous();
    const int64_t width = y.size(1);
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    each_row(y.size(0), [&](int64_t r) {
      for (int64_t i = r * width; i < (r + 1) * width; ++i) yp[i] = xp[i] + yp[i];
    });
    return y;
  }

  // gate_up [n, 2 I] -> SiLU(gate) · up [n, I]
  static at::Tensor silu_times(const at::Tensor& gate_up) {
    const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
    const at::Tensor g = gate_up.contiguous();
    at::Tensor out = at::silu(g.slice(1, 0, width)).contiguous();
    const float* up = g.data_ptr<float>() + width;
    float* op = out.data_ptr<float>();
    each_row(rows, [&](int64_t r) {
      for (int64_t d = 0; d < width; ++d) op[r * width + d] = op[r * width + d] * up[r * 2 * width + d];
    });
    return out;
  }

  // Rows offset … offset+n−1 of qkv [N, q_size + 2 kv_size] -> their q rotated [heads, n, hd]; k rotated and v stored at
  // slots start … start+n−1 of one layer's keys/values [kv_heads, capacity, hd]. `Transformer._rotate`: x·cos +
  // rotate_half(x)·sin, where rotate_half(x) = (−x[half:], x[:half]), at row offset+j of cos/sin [1, N, hd].
  at::Tensor rotate_and_store(const at::Tensor& qkv, int64_t offset, int64_t n, at::Tensor keys, at::Tensor values, int64_t start,
                              const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t width = qkv.size(1), hd = head_dim_, half = hd / 2;
    const int64_t q_size = heads_ * hd, kv_size = kv_heads_ * hd;
    at::Tensor q = at::empty({heads_, n, hd}, qkv.options());
    const float *src = qkv.data_ptr<float>() + offset * width, *cp = cos.data_ptr<float>() + offset * hd,
                *sp = sin.data_ptr<float>() + offset * hd;
    float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
    auto rotate = [&](const float* x, const float* c, const float* s, float* out) {
      for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] + (-x[d + half]) * s[d];
      for (int64_t d = half; d < hd; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
    };
    each_row(n, [&](int64_t j) {
      const float *row = src + j * width, *c = cp + j * hd, *s = sp + j * hd;
      for (int64_t h = 0; h < heads_; ++h) rotate(row + h * hd, c, s, qp + (h * n + j) * hd);
      for (int64_t h = 0; h < kv_heads_; ++h) {
        rotate(row + q_size + h * hd, c, s, kp + h * keys.stride(0) + (start + j) * keys.stride(1));
        std::memcpy(vp + h * values.stride(0) + (start + j) * values.stride(1), row + q_size + kv_size + h * hd,
                    hd * sizeof(float));
      }
    });
    return q;
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
           py::arg("values"), py::arg("starts"), py::arg("counts"), py::arg("cos"), py::arg("sin"), py::arg("masks"));
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses for `items` long tasks", py::arg("items"));
}
