// What the step's kernels share (decode_attention.cpp reads the KV cache's rows with these,
// matvec.cpp the weights'): reading ahead of a row, and sixteen of its elements as float32 in
// one AVX-512 register (eight in an AVX2 one).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace llmchat {

// Asks for `bytes` of a row (whole cache lines) 8 KiB past `p`, into the L2 cache. Where a kernel
// reads a row in fewer instructions than it takes to arrive, it outruns the CPU's own
// prefetching (which restarts at each 4 KiB page) and waits on memory. Measured on a 2-core
// Xeon, the model's matrices from memory (a plain read: ~24 GB/s), nothing / 2 KiB ahead into
// L1 / 8 KiB into L2: int8 17.5 / 21.4-22.9 / 27.1-30.9 GB/s, bfloat16 20 / 21.1-21.7 / 22.6-23.5,
// float32 ~24.5 / 25.2-25.6 / 25.6-26.2 (three alternating rounds for the last two); the decode
// attention's float32 K/V in the step, 520 positions: 75 / 54 us a layer. On the 2-core AVX-512
// EPYC (Zen 5), the built-in model's matrices, one row of x, nothing / 8 KiB ahead: float32
// 22.1 / 26.9 GB/s, bfloat16 25.6 / 28.9, int8 15.5 / 28.0, w4 18.9 / 19.0 (4, 16 and 32 KiB: no
// better, within the machine's noise): w4 is not waiting on memory.
#ifndef LLMCHAT_AHEAD  // another distance to compare: LLMCHAT_KERNEL_CFLAGS=-DLLMCHAT_AHEAD=0 (none)
#define LLMCHAT_AHEAD 8192
#endif
inline void read_ahead(const void* p, int64_t bytes) {
  constexpr int64_t kAhead = LLMCHAT_AHEAD;
  if (kAhead == 0) return;
  for (int64_t line = 0; line < bytes; line += 64) {
    __builtin_prefetch(static_cast<const char*>(p) + kAhead + line, 0, 2);  // read, keep in L2
  }
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

// Eight of a row's elements as float32 in one AVX2 register: matvec.cpp's rows_fma and
// matvec_rows.h's tiles on CPUs without AVX-512 (most laptops' and desktops', AMD's before Zen 4);
// decode_attention.cpp's register tiles on every CPU with AVX2.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMCHAT_AVX2_FLOATS 1
#include <immintrin.h>

namespace llmchat {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // a bfloat16 is a float32's upper half
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float total8(__m256 s) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1)));
}

}  // namespace llmchat
#endif
