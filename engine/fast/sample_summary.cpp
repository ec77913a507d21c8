// A decode step's draw and everything the panels show of it, in one call over the logits:
// the chosen token (greedy, drawn by inverse CDF, or given), its logprob and rank, the
// distribution's entropy, and its top k. In torch ops the same took ten calls, each paying
// its dispatch, and right after a step each of those costs 15-35 us more (docs/benchmarks-history.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// Chunks of this many logits keep their largest value, so the top-k scan skips almost all of them.
constexpr int64_t kChunk = 16;
// Blocks of this many logits (16 KB, in L1 while their two passes run) are summed by one thread
// each, in parallel: the exp of every logit is the kernel's cost (Gemma 3's 262,144 took ~0.6 ms
// on one Zen 1 core). Each block's sums come out the same on any number of threads.
constexpr int64_t kBlock = 4096;

// A removed token is -inf. Tested on the bits, because -ffast-math lets the compiler assume
// no value is infinite. (A NaN or +inf logit counts as removed too.)
inline bool kept(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

inline float minus_infinity() {
  const uint32_t bits = 0xff800000u;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// One block's sums, taken against the block's own largest logit `peak` (so no thread waits for
// the whole row's): total = sum exp(t), weighted = sum exp(t) t, t = scale (x - peak).
struct BlockSums {
  float peak = -FLT_MAX, total = 0.0f, weighted = 0.0f;
};

BlockSums block_sums(const float* x, int64_t begin, int64_t end, float scale, float* chunk_max) {
  BlockSums sums;
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t stop = std::min(end, c + kChunk);
    float best = -FLT_MAX;
#pragma omp simd reduction(max : best)
    for (int64_t i = c; i < stop; ++i) best = std::max(best, kept(x[i]) ? x[i] : -FLT_MAX);
    chunk_max[c / kChunk] = best;
    sums.peak = std::max(sums.peak, best);
  }
  if (sums.peak == -FLT_MAX) return sums;  // every token here removed
  const float peak = sums.peak;
  float total = 0.0f, weighted = 0.0f;
#pragma omp simd reduction(+ : total, weighted)
  for (int64_t i = begin; i < end; ++i) {
    const float t = scale * (x[i] - peak);
    const float w = kept(x[i]) ? std::exp(t) : 0.0f;
    total += w;
    weighted += kept(x[i]) ? w * t : 0.0f;
  }
  sums.total = total;
  sums.weighted = weighted;
  return sums;
}

// logits: float32 [V], removed tokens -inf; the distribution is softmax(scale * logits).
// chosen >= 0 describes that token; else u in [0, 1) draws one; with neither, the most probable
// token is taken.
// Returns float32 [4 + 2k]: chosen id, its logprob, entropy (nats), rank, top-k probabilities,
// top-k ids (ids and ranks are exact in float32 below 2**24, far above any vocabulary size).
at::Tensor sample_summary(const at::Tensor& logits, double scale_arg, int64_t chosen,
                          std::optional<double> u, int64_t k) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_summary: the logits must be one contiguous float32 row");
  TORCH_CHECK(scale_arg > 0.0, "sample_summary: the scale must be positive");
  const float* x = logits.data_ptr<float>();
  const int64_t V = logits.numel();
  TORCH_CHECK(chosen < V, "sample_summary: token ", chosen, " is outside the vocabulary");
  const float scale = static_cast<float>(scale_arg);
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  k = std::min(k, V);
  const int64_t slots = std::max<int64_t>(k, 1);  // greedy needs the top one even when k is 0

  thread_local std::vector<float> chunk_max;  // reused by the thread that samples, step after step
  thread_local std::vector<BlockSums> block;
  chunk_max.resize(chunks);
  block.resize(blocks);
  float* chunk_maxima = chunk_max.data();
  BlockSums* sums = block.data();
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b)
      sums[b] = block_sums(x, b * kBlock, std::min(V, (b + 1) * kBlock), scale, chunk_maxima);
  });

  float peak = -FLT_MAX;
  for (int64_t b = 0; b < blocks; ++b) peak = std::max(peak, sums[b].peak);
  TORCH_CHECK(peak > -FLT_MAX, "sample_summary: every token was removed");
  // Each block's sums, moved from its peak to the row's: a block's weights are its own times
  // exp(d), d = scale (block peak - peak), and each t grows by d. mass[b] is the block's share
  // of Z, in the row's terms, for the draw.
  thread_local std::vector<float> mass;
  mass.resize(blocks);
  float total = 0.0f, weighted = 0.0f;  // total = Z; the entropy is ln Z - sum(weight t) / Z
  for (int64_t b = 0; b < blocks; ++b) {
    mass[b] = 0.0f;
    if (!(sums[b].total > 0.0f)) continue;
    const float d = scale * (sums[b].peak - peak);
    const float factor = std::exp(d);
    mass[b] = sums[b].total * factor;
    total += mass[b];
    weighted += factor * (sums[b].weighted + d * sums[b].total);
  }
  const float log_total = std::log(total);

  // The top k, largest first, the lower id first among equals (as argmax takes the first).
  std::vector<float> top_value(slots, -FLT_MAX);
  std::vector<int64_t> top_id(slots, 0);
  int64_t filled = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (filled == slots && !(chunk_maxima[c] > top_value[slots - 1])) continue;
    for (int64_t i = c * kChunk; i < std::min(V, (c + 1) * kChunk); ++i) {
      const float v = kept(x[i]) ? x[i] : -FLT_MAX;
      if (filled == slots && !(v > top_value[slots - 1])) continue;
      int64_t at = filled < slots ? filled++ : slots - 1;
      for (; at > 0 && top_value[at - 1] < v; --at) {
        top_value[at] = top_value[at - 1];
        top_id[at] = top_id[at - 1];
      }
      top_value[at] = v;
      top_id[at] = i;
    }
  }

  if (chosen < 0 && !u) {
    chosen = top_id[0];
  } else if (chosen < 0) {
    // Inverse CDF: the first token whose cumulative weight passes u Z (a removed token adds
    // no weight, so it is never the first). Whole blocks, then whole chunks, are skipped by
    // their sums; only the block that holds the token has its weights computed again.
    auto weight = [&](int64_t i) { return kept(x[i]) ? std::exp(scale * (x[i] - peak)) : 0.0f; };
    const float target = static_cast<float>(*u) * total;
    float running = 0.0f;
    int64_t b = 0;
    for (; b < blocks - 1 && running + mass[b] <= target; ++b) running += mass[b];
    const int64_t begin = b * kBlock, end = std::min(V, begin + kBlock);
    for (int64_t c = begin; c < end && chosen < 0; c += kChunk) {
      const int64_t stop = std::min(end, c + kChunk);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = c; i < stop; ++i) sum += weight(i);
      if (running + sum <= target) {
        running += sum;
        continue;
      }
      for (int64_t i = c; i < stop && chosen < 0; ++i) {
        running += weight(i);
        if (running > target) chosen = i;
      }
    }
    // Rounding left u Z past the block's (or the row's) end: its last kept token.
    for (int64_t i = end - 1; chosen < 0 && i >= 0; --i) {
      if (kept(x[i])) chosen = i;
    }
  }

  const float picked = x[chosen];
  const bool removed = !kept(picked);  // a token the filters removed ranks after every kept one
  int64_t above = 0;
  if (chosen != top_id[0]) {  // the top one (greedy, and most draws) has nothing above it
#pragma omp simd reduction(+ : above)
    for (int64_t i = 0; i < V; ++i) above += (kept(x[i]) && (removed || x[i] > picked)) ? 1 : 0;
  }

  auto out = logits.new_empty({4 + 2 * k});
  float* o = out.data_ptr<float>();
  o[0] = static_cast<float>(chosen);
  o[1] = removed ? minus_infinity() : scale * (picked - peak) - log_total;
  o[2] = log_total - weighted / total;
  o[3] = static_cast<float>(above + 1);
  for (int64_t j = 0; j < k; ++j) {
    const bool real = j < filled && top_value[j] > -FLT_MAX;  // fewer tokens kept than k: the rest are 0
    o[4 + j] = real ? std::exp(scale * (top_value[j] - peak) - log_total) : 0.0f;
    o[4 + k + j] = static_cast<float>(top_id[j]);
  }
  return out;
}

}  // namespace

// The op's schema is declared in Python (engine/fast/kernels.py).
TORCH_LIBRARY_IMPL(llmchat, CPU, m) { m.impl("sample_summary", sample_summary); }
