// What the step's kernels share (decode_attention.cpp reads the KV cache's rows with these,
// matvec.cpp the weights'): reading ahead of a row, and sixteen of its elements as float32 in
// one AVX-512 register.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace llmchat {

// Asks for `bytes` of a row (whole cache lines) 2 KiB past `p`, a few rows ahead of the loop.
// Where a kernel reads a row in fewer instructions than it takes to arrive, it outruns the CPU's
// own prefetching (which restarts at each 4 KiB page) and waits on memory. Measured on a 2-core
// Xeon, the model's matrices from memory, without / with (a plain read: ~24 GB/s): bfloat16 20 /
// 23 GB/s, float16 16.5 / 22, int8 17.5 / 20.5 (float32's were level); the decode attention's
// float32 K/V in the step, 520 positions: 75 / 54 us a layer.
inline void read_ahead(const void* p, int64_t bytes) {
  constexpr int64_t kAhead = 2048;
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + kAhead + line);
}

}  // namespace llmchat

#if defined(__AVX512F__)
#include <immintrin.h>

namespace llmchat {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // a bfloat16 is a float32's upper half
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

}  // namespace llmchat
#endif
