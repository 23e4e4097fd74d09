// Three small per-layer ops of the Llama block, each fused into one pass over its tensor, for a CPU (guide §11: the
// engine step, whose time they share with the matmuls and the kernel of §7).
//
// In plain torch RMSNorm takes seven ops (a square, a sum, a division, an add, a reciprocal square root, two
// multiplies; in bf16 also a conversion to fp32 and one back), RoPE four and SiLU-and-multiply two; each reads and
// writes the whole tensor and, on a small decode batch, costs more in launching than in arithmetic. Here each is
// one loop. They do the same floating-point operations in the same order as paged/model/llama.py's torch code, in fp32
// and in bf16 (the library is compiled with -ffp-contract=off, so a * b + c is never fused into one rounding; bf16
// values are computed in fp32 and rounded to bf16 where torch rounds them), and so give the same bits. One exception:
// torch's elementwise loop cuts its work between threads at element counts, and a piece that begins inside a row runs
// its vectors from there; where that cut is off the vector step, SiLU-and-multiply computes a few elements with the
// vector exp where torch uses the scalar one (or the reverse), and those fp32 results can differ by a few ulp (width
// 3000 on two threads; SmolLM2's 1536 puts every cut on a vector step and is exact).
//
//   rms_norm      hidden [num_tokens, hidden_size] (rows contiguous), delta (the same, or None), weight [hidden_size]
//                 hidden += delta in place, then returns F.rms_norm(hidden, weight, eps)   (vLLM's fused_add_rms_norm)
//   rotary        x [num_tokens, heads, head_dim] (head_dim contiguous), cos and signed_sin [num_tokens, head_dim],
//                 in place: x = x * cos + roll(x, head_dim / 2) * signed_sin   (HF's rotate_half, sign in the table)
//   silu_and_mul  gate_up [num_tokens, 2 * intermediate] -> silu(gate) * up [num_tokens, intermediate]

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rms_norm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kGrain = 1 << 16;       // elements below which a loop stays on one thread
constexpr int64_t kSmallGrain = 1 << 12;  // the same for the loops with little work per element

// kLanes values of a row as floats, and back (bf16 rounded to nearest even, as torch rounds it).
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}
inline void store(float* p, const Vec& v) { v.store(p); }
inline void store(BFloat16* p, const Vec& v) {
  at::vec::convert_from_float<BFloat16>(v, v).store(p, kLanes);
}

// torch's elementwise loops run vectors of T two at a time and finish a row's last elements one by one; where the
// vector and scalar code differ (the exp of SiLU), the boundary must fall where torch's does.
template <typename T>
constexpr int64_t kTorchStep = 2 * at::vec::Vectorized<T>::size();

// f(T{}) with T the element type of a tensor that its op has checked is float32 or bfloat16.
template <typename F>
void dispatch(const Tensor& tensor, const F& f) {
  if (tensor.scalar_type() == at::kFloat)
    f(float{});
  else
    f(BFloat16{});
}

// The sum of the squares of n values, added in the order of torch's sum over a contiguous row (its cascade sum in
// aten/src/ATen/native/cpu/SumKernel.cpp): vectors of eight values in four interleaved running sums, each summed in
// chunks of 16 vectors so that only values of a similar size meet; the four, then the leftover values one by one,
// then the eight lanes. Rows shorter than a vector take the same path on single values. Eight lanes, because torch
// runs the sum of its AVX2 build on an AVX-512 CPU too (paged/model/llama.py uses this op only on those two).
constexpr int64_t kSumLanes = 8;
typedef float Lanes __attribute__((vector_size(kSumLanes * sizeof(float))));  // adds lane by lane, as a vector

template <typename Acc, typename Load>
Acc cascade_sum(Load load_at, int64_t size) {
  constexpr int64_t kIlp = 4, kLevels = 4;
  const int64_t groups = size / kIlp;
  int64_t ceil_log2 = 1;
  while (groups > 2 && (int64_t{1} << ceil_log2) < groups) ++ceil_log2;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels), level_step = int64_t{1} << level_power;
  Acc acc[kLevels][kIlp] = {};
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += load_at(i * kIlp + k);
    for (int64_t level = 1; level < kLevels; ++level) {       // carry a full chunk up a level
      for (int64_t k = 0; k < kIlp; ++k) acc[level][k] += acc[level - 1][k], acc[level - 1][k] = Acc{};
      if ((i & ((level_step - 1) << (level * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += load_at(i * kIlp + k);
  for (int64_t level = 1; level < kLevels; ++level)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += acc[level][k];
  for (int64_t j = groups * kIlp; j < size; ++j) acc[0][0] += load_at(j);
  for (int64_t k = 1; k < kIlp; ++k) acc[0][0] += acc[0][k];
  return acc[0][0];
}

// squares: room for n floats, which receive the squares of x as fp32 (torch's x.float().pow(2)).
template <typename T>
float sum_of_squares(const T* x, int64_t n, float* squares) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load(x + i);
    (v * v).store(squares + i);
  }
  for (; i < n; ++i) squares[i] = static_cast<float>(x[i]) * static_cast<float>(x[i]);
  if (n < kSumLanes) return cascade_sum<float>([&](int64_t j) { return squares[j]; }, n);
  const int64_t vectors = n / kSumLanes;
  const Lanes sums = cascade_sum<Lanes>([&](int64_t j) {
    Lanes v;
    std::memcpy(&v, squares + j * kSumLanes, sizeof v);
    return v;
  }, vectors);
  float total = 0.f;
  for (int64_t j = vectors * kSumLanes; j < n; ++j) total += squares[j];
  for (int64_t k = 0; k < kSumLanes; ++k) total += sums[k];
  return total;
}

template <typename T>
void rms_norm_rows(T* hidden, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps,
                   int64_t hidden_stride, int64_t delta_stride) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSmallGrain / n), [&](int64_t begin, int64_t end) {
    std::vector<float> squares(n);
    for (int64_t t = begin; t < end; ++t) {
      T* h = hidden + t * hidden_stride;
      if (delta != nullptr) {                                   // the residual add, rounded to T as torch's +=
        const T* d = delta + t * delta_stride;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) store(h + i, load(h + i) + load(d + i));
        for (; i < n; ++i) h[i] = static_cast<T>(static_cast<float>(h[i]) + static_cast<float>(d[i]));
      }
      // torch: rsqrt(sum(x^2) / n + eps), then (x * r) * weight in fp32, rounded once to T
      const float r = 1.f / std::sqrt(sum_of_squares(h, n, squares.data()) / static_cast<float>(n) + eps);
      T* o = out + t * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) store(o + i, (load(h + i) * Vec(r)) * load(weight + i));
      for (; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(h[i]) * r * static_cast<float>(weight[i]));
    }
  });
}

Tensor rms_norm(Tensor& hidden, const std::optional<Tensor>& delta, const Tensor& weight_in, double eps) {
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.stride(1) == 1 &&
                        (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
                    "rms_norm: hidden must be float32 or bfloat16 [num_tokens, hidden_size], rows contiguous");
  const Tensor weight = weight_in.contiguous();
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden.size(1) &&
                        weight.scalar_type() == hidden.scalar_type(),
                    "rms_norm: weight must be [hidden_size], of hidden's dtype");
  if (delta.has_value())
    TORCH_CHECK_VALUE(delta->sizes() == hidden.sizes() && delta->stride(1) == 1 &&
                          delta->scalar_type() == hidden.scalar_type(),
                      "rms_norm: delta must have hidden's shape and dtype, rows contiguous");
  if (hidden.size(1) > at::internal::GRAIN_SIZE) {  // torch shares so long a row's sum among threads: use its ops
    if (delta.has_value()) hidden.add_(*delta);
    return at::rms_norm(hidden, {hidden.size(1)}, weight, eps);
  }
  Tensor out = at::empty(hidden.sizes(), hidden.options());
  dispatch(hidden, [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows(hidden.data_ptr<T>(), delta.has_value() ? delta->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                  out.data_ptr<T>(), hidden.size(0), hidden.size(1), static_cast<float>(eps), hidden.stride(0),
                  delta.has_value() ? delta->stride(0) : 0);
  });
  return out;
}

// x * cos + roll(x) * signed_sin, each product and the sum rounded to T, as torch's mul, mul_ and add_ round them.
template <typename T>
inline T rotate(float a, float c, float b, float s) {
  return static_cast<T>(static_cast<float>(static_cast<T>(a * c)) + static_cast<float>(static_cast<T>(b * s)));
}
template <typename T>
inline Vec rounded(const Vec& v) { return v; }
template <>
inline Vec rounded<BFloat16>(const Vec& v) {  // v rounded to bf16 and read back as floats
  return std::get<0>(at::vec::convert_to_float<BFloat16>(at::vec::convert_from_float<BFloat16>(v, v)));
}

template <typename T>
void rotary_rows(T* data, const T* c, const T* s, int64_t tokens, int64_t heads, int64_t D, int64_t stride_token,
                 int64_t stride_head) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens * heads, std::max<int64_t>(1, kSmallGrain / D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t token = row / heads;
      T* v = data + token * stride_token + (row % heads) * stride_head;
      const T* ct = c + token * D;
      const T* st = s + token * D;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {   // the two halves of the head at once, from the old values
        const Vec a = load(v + i), b = load(v + half + i);
        store(v + i, rounded<T>(a * load(ct + i)) + rounded<T>(b * load(st + i)));
        store(v + half + i, rounded<T>(b * load(ct + half + i)) + rounded<T>(a * load(st + half + i)));
      }
      for (; i < half; ++i) {
        const float a = static_cast<float>(v[i]), b = static_cast<float>(v[half + i]);
        v[i] = rotate<T>(a, static_cast<float>(ct[i]), b, static_cast<float>(st[i]));
        v[half + i] = rotate<T>(b, static_cast<float>(ct[half + i]), a, static_cast<float>(st[half + i]));
      }
    }
  });
}

Tensor& rotary(Tensor& x, const Tensor& cos_in, const Tensor& sin_in) {
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1 &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "rotary: x must be float32 or bfloat16 [num_tokens, heads, head_dim] with head_dim contiguous");
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                        cos.size(1) == x.size(2) && cos.scalar_type() == x.scalar_type() &&
                        sin.scalar_type() == x.scalar_type(),
                    "rotary: cos and signed_sin must be [num_tokens, head_dim], of x's dtype");
  TORCH_CHECK_VALUE(x.size(2) % 2 == 0, "rotary: head_dim must be even");
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    rotary_rows(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0),
                x.stride(1));
  });
  return x;
}

template <typename T>
void silu_and_mul_rows(const T* in, T* o, int64_t tokens, int64_t width, int64_t in_stride) {
  const int64_t vector_end = width / kTorchStep<T> * kTorchStep<T>;  // torch's last full pair of vectors
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrain / width), [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = in + t * in_stride;
      const T* up = gate + width;
      T* row = o + t * width;
      int64_t i = 0;
      for (; i < vector_end; i += kLanes) {  // silu(g) = g / (1 + exp(-g)), rounded to T, then times up
        const Vec g = load(gate + i);
        store(row + i, rounded<T>(g / (one + g.neg().exp())) * load(up + i));
      }
      for (; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
        row[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
      }
    }
  });
}

Tensor silu_and_mul(const Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1 &&
                        (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
                    "silu_and_mul: gate_up must be float32 or bfloat16 [num_tokens, 2 * intermediate], "
                    "rows contiguous");
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2;
  Tensor out = at::empty({tokens, width}, gate_up.options());
  dispatch(gate_up, [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_rows(gate_up.data_ptr<T>(), out.data_ptr<T>(), tokens, width, gate_up.stride(0));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_cpu, m) {
  m.def("rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> Tensor(a!)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(paged_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
