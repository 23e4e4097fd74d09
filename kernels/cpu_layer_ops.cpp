// Two small per-layer ops of the Llama block, each fused into one pass over its tensor, for a CPU (guide §7).
//
// In plain torch RoPE takes four ops (a multiply, a roll, a multiply, an add) and SiLU-and-multiply two; each
// reads and writes the whole tensor and, on a small decode batch, costs more in launching than in arithmetic.
// Here each is one loop. They do the same floating-point operations in the same order as paged/model.py's torch
// code (the library is compiled with -ffp-contract=off, so a * b + c is never fused into one rounding), and so
// give the same bits.
//
//   rotary        x [num_tokens, heads, head_dim] (head_dim contiguous), cos and signed_sin [num_tokens, head_dim],
//                 in place: x = x * cos + roll(x, head_dim / 2) * signed_sin   (HF's rotate_half, sign in the table)
//   silu_and_mul  gate_up [num_tokens, 2 * intermediate] -> silu(gate) * up [num_tokens, intermediate]

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kGrain = 1 << 16;  // elements below which a loop stays on one thread

Tensor& rotary(Tensor& x, const Tensor& cos_in, const Tensor& sin_in) {
  TORCH_CHECK_VALUE(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
                    "rotary: x must be float32 [num_tokens, heads, head_dim] with head_dim contiguous");
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                        cos.size(1) == x.size(2) && cos.scalar_type() == at::kFloat &&
                        sin.scalar_type() == at::kFloat,
                    "rotary: cos and signed_sin must be float32 [num_tokens, head_dim]");
  TORCH_CHECK_VALUE(x.size(2) % 2 == 0, "rotary: head_dim must be even");
  const int64_t heads = x.size(1), D = x.size(2), half = D / 2;
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, x.size(0) * heads, std::max<int64_t>(1, kGrain / D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t token = row / heads;
      float* v = data + token * x.stride(0) + (row % heads) * x.stride(1);
      const float* ct = c + token * D;
      const float* st = s + token * D;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {   // the two halves of the head at once, from the old values
        const Vec a = Vec::loadu(v + i), b = Vec::loadu(v + half + i);
        (a * Vec::loadu(ct + i) + b * Vec::loadu(st + i)).store(v + i);
        (b * Vec::loadu(ct + half + i) + a * Vec::loadu(st + half + i)).store(v + half + i);
      }
      for (; i < half; ++i) {
        const float a = v[i], b = v[half + i];
        v[i] = a * ct[i] + b * st[i];
        v[half + i] = b * ct[half + i] + a * st[half + i];
      }
    }
  });
  return x;
}

Tensor silu_and_mul(const Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kFloat &&
                        gate_up.stride(1) == 1,
                    "silu_and_mul: gate_up must be float32 [num_tokens, 2 * intermediate], rows contiguous");
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2;
  Tensor out = at::empty({tokens, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrain / width), [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = in + t * gate_up.stride(0);
      const float* up = gate + width;
      float* row = o + t * width;
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes) {  // silu(g) = g / (1 + exp(-g)), as torch computes it
        const Vec g = Vec::loadu(gate + i);
        ((g / (one + g.neg().exp())) * Vec::loadu(up + i)).store(row + i);
      }
      for (; i < width; ++i) row[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_cpu, m) {
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> Tensor(a!)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(paged_cpu, CPU, m) {
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
