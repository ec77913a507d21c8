// Per-operator headers, not <ATen/ATen.h>: the build is on a first start's critical path, and
// every ATen function's declaration made it ~2 s slower (8.1 s -> 6.0 s here).
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The most keys one task reads (its scores hold kBlock for each query head).
constexpr int64_t kBlock = 512;
// A block's max score for a query head with none of its keys in it: finite (built with
// -ffast-math), below any real score, so the merge's max is a real one; the block is skipped there.
constexpr float kNone = -1e30f;
// Below this many K/V rows in all, starting and joining the threads costs more than they save
// (about even at 150-200 rows on two threads): the calling thread does the work alone.
constexpr int64_t kRowsInline = 192;

// A row of the cache as float32: float32 rows are used in place; other types are widened once
// into `buffer` (L1-resident), so the G query heads that share the row do not convert it G times.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

#if defined(__F16C__)
// float16 -> float32 eight at a time (the scalar conversion is a bit-twiddling function call).
template <>
inline const float* as_float<at::Half>(const at::Half* row, float* buffer, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    _mm256_storeu_ps(buffer + d, _mm256_cvtph_ps(half));
  }
  for (; d < D; ++d) buffer[d] = static_cast<float>(row[d]);
  return buffer;
}
#endif

#if defined(__AVX512F__)
constexpr int64_t kMaxD = 256;

using llmchat::load16;  // sixteen elements of a 16-bit or int8 cache row as float32

// block_scores and block_values (below) for 16-bit and int8 rows, D a multiple of 16: each row is
// widened once into registers and shared by the G query heads (the plain loops spent ~28 ns a
// row widening it through a buffer). float32 rows take the register tiles below, as with AVX2
// only (a Zen 4, SmolLM2's heads at 2,000 positions, a verify's 5 tokens, us a layer cold: 386-396
// in the plain loops, 331-342 in the tiles; 16-bit rows: 273-282 here, 246-309 in the tiles).
template <typename T>
void block_scores_avx512(const float* queries, int64_t G, int64_t D, const T* keys, const float* key_scales,
                         float scale, int64_t n, float* scores) {
  const int64_t vectors = D / 16;
  __m512 key[kMaxD / 16];
  for (int64_t t = 0; t < n; ++t) {
    llmchat::read_ahead(keys + t * D, D * sizeof(T));
    for (int64_t j = 0; j < vectors; ++j) key[j] = load16(keys + t * D + 16 * j);
    const float row = key_scales ? key_scales[t] * scale : scale;
    for (int64_t g = 0; g < G; ++g) {
      const float* query = queries + g * D;
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(query), key[0]);
      for (int64_t j = 1; j < vectors; ++j) dot = _mm512_fmadd_ps(_mm512_loadu_ps(query + 16 * j), key[j], dot);
      scores[g * kBlock + t] = _mm512_reduce_add_ps(dot) * row;
    }
  }
}

template <typename T>
void block_values_avx512(const float* scores, int64_t G, int64_t D, const T* values, const float* value_scales,
                         int64_t n, float* out) {
  const int64_t vectors = D / 16;
  __m512 value[kMaxD / 16];
  for (int64_t t = 0; t < n; ++t) {
    llmchat::read_ahead(values + t * D, D * sizeof(T));
    for (int64_t j = 0; j < vectors; ++j) value[j] = load16(values + t * D + 16 * j);
    const float row = value_scales ? value_scales[t] : 1.0f;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * kBlock + t] * row);
      float* o = out + g * D;
      for (int64_t j = 0; j < vectors; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_fmadd_ps(p, value[j], _mm512_loadu_ps(o + 16 * j)));
    }
  }
}
#endif

#if defined(LLMCHAT_AVX2_FLOATS)
// With AVX2 (a Zen 1, most laptops; float32 rows where there is AVX-512 too), a block's scores and
// outputs as small matrix products whose sums stay in registers: 2 query heads x 4 keys a tile
// for the scores (one horizontal sum per 4 dot products, where the plain loop made one per
// product and waited on each product's chain of FMAs), 2 query heads x 32 of D for the outputs
// over kRun rows (the plain loop loaded and stored each output row once per key). Rows other
// than float32 are widened once into `buffer` (kRun x D floats), times their int8 scale, for all
// G query heads. Zen 1, SmolLM2's heads at 2,000 positions: a verify's 5 tokens 1.4-2.6 -> 0.6-1.1
// ms a layer, one token over a bf16 cache 0.39-0.42 -> 0.26-0.39 (float32 rows: as fast,
// memory-bound); BENCHMARKS.md, "Attention over the cache".
constexpr int64_t kRun = 16;

// kRun (or fewer) rows as float32, times each row's scale where given: float32 rows in place.
template <typename T>
inline const float* run_as_float(const T* rows, const float* row_scales, int64_t count, int64_t D, float* buffer) {
  if constexpr (std::is_same_v<T, float>) return rows;
  for (int64_t t = 0; t < count; ++t) {
    const __m256 scale = _mm256_set1_ps(row_scales ? row_scales[t] : 1.0f);
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_storeu_ps(buffer + t * D + d, _mm256_mul_ps(llmchat::load8(rows + t * D + d), scale));
    }
  }
  return buffer;
}

// The totals of four registers' lanes, in one.
inline __m128 totals4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

// Query heads g (and g + 1 where `two`) against keys k..k+3 (float32, rows D apart): 4 scores each.
template <bool two>
inline void score_tile(const float* q0, const float* k, int64_t D, float scale, float* out0) {
  __m256 a[4], b[4];
  for (int j = 0; j < 4; ++j) a[j] = b[j] = _mm256_setzero_ps();
  const float* q1 = q0 + D;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x0 = _mm256_loadu_ps(q0 + d);
    const __m256 x1 = two ? _mm256_loadu_ps(q1 + d) : x0;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 key = _mm256_loadu_ps(k + j * D + d);
      a[j] = _mm256_fmadd_ps(x0, key, a[j]);
      if (two) b[j] = _mm256_fmadd_ps(x1, key, b[j]);
    }
  }
  const __m128 scales = _mm_set1_ps(scale);
  _mm_storeu_ps(out0, _mm_mul_ps(totals4(a[0], a[1], a[2], a[3]), scales));
  if (two) _mm_storeu_ps(out0 + kBlock, _mm_mul_ps(totals4(b[0], b[1], b[2], b[3]), scales));
}

template <typename T>
void block_scores_avx2(const float* queries, int64_t G, int64_t D, const T* keys, const float* key_scales,
                       float scale, int64_t n, float* scores, float* buffer) {
  for (int64_t first = 0; first < n; first += kRun) {
    const int64_t count = std::min(kRun, n - first);
    llmchat::read_ahead(keys + first * D, count * D * sizeof(T));
    const float* run = run_as_float(keys + first * D, key_scales ? key_scales + first : nullptr, count, D, buffer);
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {
      int64_t g = 0;
      for (; g + 2 <= G; g += 2) score_tile<true>(queries + g * D, run + t * D, D, scale, scores + g * kBlock + first + t);
      if (g < G) score_tile<false>(queries + g * D, run + t * D, D, scale, scores + g * kBlock + first + t);
    }
    for (; t < count; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        __m256 dot = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          dot = _mm256_fmadd_ps(_mm256_loadu_ps(queries + g * D + d), _mm256_loadu_ps(run + t * D + d), dot);
        }
        scores[g * kBlock + first + t] = llmchat::total8(dot) * scale;
      }
    }
  }
}

// out[g] (and out[g + 1] where `two`), W floats of D from `d`, += their weights times `count`
// value rows (float32, D apart).
template <bool two, int W>
inline void value_tile(const float* p0, const float* values, int64_t count, int64_t D, int64_t d, float* out0) {
  __m256 a[W], b[W];
  for (int j = 0; j < W; ++j) {
    a[j] = _mm256_loadu_ps(out0 + d + 8 * j);
    b[j] = two ? _mm256_loadu_ps(out0 + D + d + 8 * j) : a[j];
  }
  for (int64_t t = 0; t < count; ++t) {
    const __m256 w0 = _mm256_broadcast_ss(p0 + t);
    const __m256 w1 = two ? _mm256_broadcast_ss(p0 + kBlock + t) : w0;
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) {
      const __m256 value = _mm256_loadu_ps(values + t * D + d + 8 * j);
      a[j] = _mm256_fmadd_ps(w0, value, a[j]);
      if (two) b[j] = _mm256_fmadd_ps(w1, value, b[j]);
    }
  }
  for (int j = 0; j < W; ++j) {
    _mm256_storeu_ps(out0 + d + 8 * j, a[j]);
    if (two) _mm256_storeu_ps(out0 + D + d + 8 * j, b[j]);
  }
}

template <bool two>
inline void value_tiles(const float* p0, const float* values, int64_t count, int64_t D, float* out0) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) value_tile<two, 4>(p0, values, count, D, d, out0);
  for (; d < D; d += 8) value_tile<two, 1>(p0, values, count, D, d, out0);
}

template <typename T>
void block_values_avx2(const float* scores, int64_t G, int64_t D, const T* values, const float* value_scales,
                       int64_t n, float* out, float* buffer) {
  for (int64_t first = 0; first < n; first += kRun) {
    const int64_t count = std::min(kRun, n - first);
    llmchat::read_ahead(values + first * D, count * D * sizeof(T));
    const float* run = run_as_float(values + first * D, value_scales ? value_scales + first : nullptr, count, D, buffer);
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) value_tiles<true>(scores + g * kBlock + first, run, count, D, out + g * D);
    if (g < G) value_tiles<false>(scores + g * kBlock + first, run, count, D, out + g * D);
  }
}
#endif

// The rows a task's buffer holds widened: a run of them with AVX2 (above), else one.
#if defined(LLMCHAT_AVX2_FLOATS)
constexpr int64_t kWidened = kRun;
#else
constexpr int64_t kWidened = 1;
#endif

// A block's scores: scores[g * kBlock + t] = (query g . key t) * scale (times key t's int8 scale).
template <typename T>
void block_scores(const float* queries, int64_t G, int64_t D, const T* keys, const float* key_scales, float scale,
                  int64_t n, float* scores, float* widened) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, float>) {
    if (D % 16 == 0 && D <= kMaxD) return block_scores_avx512(queries, G, D, keys, key_scales, scale, n, scores);
  }
#endif
#if defined(LLMCHAT_AVX2_FLOATS)
  if (D % 8 == 0) return block_scores_avx2(queries, G, D, keys, key_scales, scale, n, scores, widened);
#endif
  for (int64_t t = 0; t < n; ++t) {
    llmchat::read_ahead(keys + t * D, D * sizeof(T));
    const float* key = as_float(keys + t * D, widened, D);
    const float row = key_scales ? key_scales[t] * scale : scale;
    for (int64_t g = 0; g < G; ++g) {
      const float* query = queries + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
      scores[g * kBlock + t] = dot * row;
    }
  }
}

// A block's share of the output: out[g] += softmax weight (g, t) * value t (times its int8 scale).
template <typename T>
void block_values(const float* scores, int64_t G, int64_t D, const T* values, const float* value_scales, int64_t n,
                  float* out, float* widened) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, float>) {
    if (D % 16 == 0 && D <= kMaxD) return block_values_avx512(scores, G, D, values, value_scales, n, out);
  }
#endif
#if defined(LLMCHAT_AVX2_FLOATS)
  if (D % 8 == 0) return block_values_avx2(scores, G, D, values, value_scales, n, out, widened);
#endif
  for (int64_t t = 0; t < n; ++t) {
    llmchat::read_ahead(values + t * D, D * sizeof(T));
    const float* value = as_float(values + t * D, widened, D);
    const float row = value_scales ? value_scales[t] : 1.0f;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * kBlock + t] * row;
      float* o = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * value[d];
    }
  }
}

// One new token's attention over the KV cache, for engine/fast/attention.py; or a few new tokens'
// (a speculative verify), each over its own positions, the cache read once for all of them.
//
// q [H, G, D] float32: the G query heads that share each of the H cached K/V heads; k, v [H, C, D]
// (rows contiguous; heads may be strided, e.g. views of a larger buffer) attended at positions
// first..position (first > 0: a sliding window's start). With n tokens, first and position hold n
// positions each and q's G heads are the tokens' in turn (G / n each): head g attends over
// first[g / (G / n)]..position[g / (G / n)]. Stored as float32, bfloat16, float16, or int8
// with one float32 scale per row (ks, vs [H, C]: token t of head h is k[h, t] * ks[h, t]). Each (head,
// block of at most kBlock keys; a head's blocks of equal length) is one task on torch's thread pool
// (on the calling thread alone for a short cache): scores, a softmax local to the block and a partial
// output; the partials are then merged with their max-and-sum weights (flash-decoding). K and V are
// each read once, as stored: a row is widened to float32 once (into vector registers, or a buffer of D
// floats; with AVX2 only, a run of kRun rows) and the G query heads then share it, and an int8 row's scale multiplies its dot product (K)
// or its softmax weight (V), never the row, so no dequantized copy of the cache is ever made.
//
// Built with -ffast-math (engine/fast/attention.py), so nothing here may rely on infinities.
template <typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* ks, const float* vs,
                  int64_t scale_head_stride, const at::Tensor& first_position, const at::Tensor& position) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: the query must be float32");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "decode_attention: K and V must share their type");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "decode_attention: each head's K/V rows must be contiguous");
  TORCH_CHECK(k.stride(0) == v.stride(0), "decode_attention: K and V must share their layout");
  const int64_t H = k.size(0), C = k.size(1), D = k.size(2), G = q.size(1), head_stride = k.stride(0);
  const int64_t tokens = position.numel();
  TORCH_CHECK(tokens >= 1 && first_position.numel() == tokens && G % tokens == 0,
              "decode_attention: one first and last position per token, and the same query heads each");
  TORCH_CHECK(position.scalar_type() == at::kLong && first_position.scalar_type() == at::kLong,
              "decode_attention: positions must be int64");
  const auto lasts = position.contiguous(), firsts = first_position.contiguous();
  const int64_t* last_of = lasts.data_ptr<int64_t>();
  const int64_t* first_of = firsts.data_ptr<int64_t>();
  const int64_t start = *std::min_element(first_of, first_of + tokens);
  const int64_t length = *std::max_element(last_of, last_of + tokens) + 1 - start;
  // Each query head's keys, as offsets from `start`: [from[g], to[g]).
  std::vector<int64_t> from(G), to(G);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t token = g / (G / tokens);
    from[g] = first_of[token] - start;
    to[g] = last_of[token] + 1 - start;
    TORCH_CHECK(from[g] < to[g], "decode_attention: a token with no position to attend to");
  }
  TORCH_CHECK(start >= 0 && length >= 1 && start + length <= C, "decode_attention: positions outside the cache");
  const bool threaded = H * length >= kRowsInline;
  // Blocks of equal length, as many for each head as make the tasks a multiple of the threads:
  // one task per head leaves a thread idle for part of the step (3 K/V heads on 2 threads: one
  // thread reads two heads, the other one).
  const int64_t threads = threaded ? at::get_num_threads() : 1;
  const int64_t split = threads / std::gcd(H, threads);
  const int64_t wanted = ((length + kBlock - 1) / kBlock + split - 1) / split * split;
  const int64_t block_length = (length + wanted - 1) / wanted;
  const int64_t blocks = (length + block_length - 1) / block_length;
  // Each task's output: with one block (up to kBlock positions) the result itself, normalized in
  // place at the end; with more, partials merged by their max-and-sum weights.
  auto result = at::zeros({H, G, D}, q.options());
  auto partials = blocks > 1 ? at::zeros({H, blocks, G, D}, q.options()) : result;
  std::vector<float> stats(2 * H * blocks * G);  // each task's max and sum per query head
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>() + start * D;  // the window's first row in each head
  const T* vp = v.data_ptr<T>() + start * D;
  float* op = partials.data_ptr<float>();
  float* mp = stats.data();
  float* sp = mp + H * blocks * G;

  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * kBlock);
    std::vector<float> widened(kWidened * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, b = task % blocks;
      const int64_t first = b * block_length, n = std::min(block_length, length - first);
      const T* keys = kp + h * head_stride + first * D;
      const T* values = vp + h * head_stride + first * D;
      const float* key_scales = ks ? ks + h * scale_head_stride + start + first : nullptr;
      const float* value_scales = vs ? vs + h * scale_head_stride + start + first : nullptr;
      const float* queries = qp + h * G * D;
      block_scores(queries, G, D, keys, key_scales, scale, n, scores.data(), widened.data());
      float* out = op + task * G * D;
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * kBlock;
        // This head's keys in the block (all of them for one token); the others weigh nothing.
        const int64_t lo = std::clamp<int64_t>(from[g] - first, 0, n), hi = std::clamp<int64_t>(to[g] - first, 0, n);
        if (lo >= hi) {  // none: the merge skips this block for this head
          std::fill(s, s + n, 0.0f);
          mp[task * G + g] = kNone;
          sp[task * G + g] = 0.0f;
          continue;
        }
        const float m = *std::max_element(s + lo, s + hi);
        float sum = 0.0f;
        std::fill(s, s + lo, 0.0f);
        std::fill(s + hi, s + n, 0.0f);
        for (int64_t t = lo; t < hi; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        mp[task * G + g] = m;
        sp[task * G + g] = sum;
      }
      block_values(scores.data(), G, D, values, value_scales, n, out, widened.data());
    }
  };
  if (!threaded) {
    work(0, H * blocks);
  } else {
    at::parallel_for(0, H * blocks, 1, work);
  }

  float* rp = result.data_ptr<float>();
  if (blocks == 1) {
    for (int64_t i = 0; i < H * G; ++i) {
      for (int64_t d = 0; d < D; ++d) rp[i * D + d] /= sp[i];
    }
    return result;
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t g = 0; g < G; ++g) {
      float m = mp[h * blocks * G + g];
      for (int64_t b = 1; b < blocks; ++b) m = std::max(m, mp[(h * blocks + b) * G + g]);
      float total = 0.0f;
      float* r = rp + (h * G + g) * D;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = (h * blocks + b) * G + g;
        if (sp[i] == 0.0f) continue;  // a block with none of this head's keys
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

// A float cache (float32, bfloat16 or float16), read as stored.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& first,
                            const at::Tensor& position) {
  switch (k.scalar_type()) {
    case at::kFloat:
      return attend<float>(q, k, v, nullptr, nullptr, 0, first, position);
    case at::kBFloat16:
      return attend<at::BFloat16>(q, k, v, nullptr, nullptr, 0, first, position);
    case at::kHalf:
      return attend<at::Half>(q, k, v, nullptr, nullptr, 0, first, position);
    default:
      TORCH_CHECK(false, "decode_attention: a float32, bfloat16 or float16 cache only");
  }
}

// An int8 cache with one float32 scale per token and head: ks, vs [H, C], rows contiguous.
at::Tensor decode_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ks,
                                 const at::Tensor& v, const at::Tensor& vs, const at::Tensor& first,
                                 const at::Tensor& position) {
  TORCH_CHECK(k.scalar_type() == at::kChar, "decode_attention_int8: K and V must be int8");
  TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat,
              "decode_attention_int8: the scales must be float32");
  TORCH_CHECK(ks.stride(1) == 1 && vs.stride(1) == 1 && ks.stride(0) == vs.stride(0) && ks.size(1) == k.size(1),
              "decode_attention_int8: the scales must be laid out [heads, capacity]");
  return attend<int8_t>(q, k, v, ks.data_ptr<float>(), vs.data_ptr<float>(), ks.stride(0), first, position);
}

}  // namespace

// The ops' schemas and shapes are declared in Python (engine/fast/attention.py), so a step can be
// traced while this builds, and the cache's capacity stays symbolic.
TORCH_LIBRARY_IMPL(llmchat, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_int8", decode_attention_int8);
}
