#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 512;

// One new token's attention over the KV cache, for engine/attention.py.
//
// q [H, G, D]: the G query heads that share each of the H cached K/V heads; k, v [H, C, D]
// (rows contiguous; heads may be strided, e.g. views of a larger buffer) with positions
// 0..position valid. Each (head, block of 512 keys) is one task on torch's thread pool:
// scores, a softmax local to the block and a partial output; the partials are then merged
// with their max-and-sum weights (flash-decoding). K and V are each read once.
//
// Built with -ffast-math (engine/attention.py), so nothing here may rely on infinities.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& position) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "decode_attention: each head's K/V rows must be contiguous");
  TORCH_CHECK(k.stride(0) == v.stride(0), "decode_attention: K and V must share their layout");
  const int64_t H = k.size(0), C = k.size(1), D = k.size(2), G = q.size(1), head_stride = k.stride(0);
  const int64_t length = position.item<int64_t>() + 1;
  TORCH_CHECK(length >= 1 && length <= C, "decode_attention: position outside the cache");
  const int64_t blocks = (length + kBlock - 1) / kBlock;
  auto out_part = at::zeros({H, blocks, G, D}, q.options());
  auto max_part = at::empty({H, blocks, G}, q.options());
  auto sum_part = at::empty({H, blocks, G}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out_part.data_ptr<float>();
  float* mp = max_part.data_ptr<float>();
  float* sp = sum_part.data_ptr<float>();

  at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, b = task % blocks;
      const int64_t first = b * kBlock, n = std::min(kBlock, length - first);
      const float* keys = kp + h * head_stride + first * D;
      const float* values = vp + h * head_stride + first * D;
      const float* queries = qp + h * G * D;
      for (int64_t t = 0; t < n; ++t) {
        const float* key = keys + t * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* query = queries + g * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
          scores[g * kBlock + t] = dot * scale;
        }
      }
      float* out = op + task * G * D;
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * kBlock;
        const float m = *std::max_element(s, s + n);
        float sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        mp[task * G + g] = m;
        sp[task * G + g] = sum;
      }
      for (int64_t t = 0; t < n; ++t) {
        const float* value = values + t * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * kBlock + t];
          float* o = out + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * value[d];
        }
      }
    }
  });

  auto result = at::zeros({H, G, D}, q.options());
  float* rp = result.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t g = 0; g < G; ++g) {
      float m = mp[h * blocks * G + g];
      for (int64_t b = 1; b < blocks; ++b) m = std::max(m, mp[(h * blocks + b) * G + g]);
      float total = 0.0f;
      float* r = rp + (h * G + g) * D;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = (h * blocks + b) * G + g;
        const float w = std::exp(mp[i] - m);
        total += w * sp[i];
        const float* o = op + i * D;
        for (int64_t d = 0; d < D; ++d) r[d] += w * o[d];
      }
      for (int64_t d = 0; d < D; ++d) r[d] /= total;
    }
  }
  return result;
}

}  // namespace

// Its shape for torch.compile is registered in Python (engine/attention.py), where the cache's
// capacity can stay symbolic.
TORCH_LIBRARY(llmchat, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor position) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmchat, CPU, m) { m.impl("decode_attention", decode_attention); }
