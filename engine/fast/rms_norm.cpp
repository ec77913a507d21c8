// RMSNorm for the eager forward's few rows: x [..., d] / sqrt(mean(x^2) + eps) * weight, float32.
//
// torch's rms_norm on a CPU is a composite of six ops (square, mean, add, rsqrt, two products), each
// dispatched on its own: ~36 us for one 576-wide row on a Zen 1, where its arithmetic is ~1 us. An
// eager step calls it twice a layer and once for the head (61 times for SmolLM2; Gemma 3's four
// norms a layer and its q/k norms, more), and so do a speculative verify and the lab's batched
// forward, which stay eager. A compiled step keeps torch's (Inductor fuses it into its loops).
// Built as part of decode_step.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace rms_norm_kernel {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: float32 x and weight only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.dim() >= 1 &&
                  x.size(-1) == weight.size(0),
              "rms_norm: contiguous x [..., d] and weight [d]");
  at::Tensor out = at::empty_like(x);
  const int64_t d = weight.size(0), rows = d == 0 ? 0 : x.numel() / d;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  // A prefill's hundreds of rows split across threads; a step's few stay on this one.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * d;
      float* o = op + r * d;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t k = 0; k < d; ++k) squares += row[k] * row[k];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(d) + epsilon);
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) o[k] = row[k] * scale * wp[k];
    }
  });
  return out;
}

}  // namespace rms_norm_kernel

TORCH_LIBRARY_IMPL(llmchat, CPU, m) { m.impl("rms_norm", rms_norm_kernel::rms_norm); }
