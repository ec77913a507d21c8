// A decode step's matrix-vector products, x [1, in] @ W.T for W [out, in], rows streamed once.
//
// Inductor's loop for the same sum (FastLlama._matvec) keeps one chain of additions per row
// and widens both operands at every step: on a CPU whose cores are slow beside its memory it
// is compute-bound (a 2-core AVX-512 Xeon: bfloat16 rows at ~12 GB/s, float32 at ~17, where
// this kernel streams them at ~23-25 and ~26-28; BENCHMARKS.md). Each thread takes a contiguous
// block of rows; independent accumulators hide the additions' latency; bfloat16 rows go
// through `vdpbf16ps` (32 products an instruction) where the CPU has it. Sums in float32, the
// result rounded to W's dtype, as the loop's is. w8's int8 rows take a float32 x and give a
// float32 result, the rows' scales applied after; where the CPU has AVX512-VNNI or AVX2, x is
// rounded to 16 bits and the rows summed in integers (rows_dpwssd, rows_madd). Up to 16 rows of x at once
// (matvec_rows.h: a speculative verify, the lab's batch) read each weight row once for all of them.
// w4's Q4_0 blocks (4-bit values, a float16 scale per 32) have an op of their own, matvec_q4
// (rows_q4_int, rows_q4), and a one-pass widening for a prefill's matmul, dequantize_q4.
// Built as part of decode_step.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLMCHAT_INT_ROWS 1  // w8's rows summed in integers by vpdpwssd (rows_dpwssd)
#elif defined(__AVX2__)
#define LLMCHAT_INT_ROWS 1  // by vpmaddwd (rows_madd)
#endif

namespace matvec_kernel {

// Rows per task of the thread pool: enough that two threads split even the smallest matrix.
constexpr int64_t kRowGrain = 64;

// The portable sum, vectorized by the compiler for the CPU it is built on (-march=native): with
// AVX2 but not AVX-512 it still streams bfloat16 rows ~2x faster than Inductor's loop
// (engine/fast/matvec.py), float32 ~1.4x; and the library builds everywhere.
template <typename W, typename X>
void rows_plain(const X* x, const W* w, X* out, int64_t in, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const W* row = w + r * in;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < in; ++k) sum += static_cast<float>(x[k]) * static_cast<float>(row[k]);
    out[r] = static_cast<X>(sum);
  }
}

#if defined(__AVX512F__)
using llmchat::load16;
using llmchat::read_ahead;

struct Lanes {  // sixteen float32 in an AVX-512 register
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename W>
  static V load(const W* p) { return load16(p); }
  static V xs(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V w, V x, V sum) { return _mm512_fmadd_ps(w, x, sum); }
  static float total(V a, V b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
};
#define LLMCHAT_FMA_ROWS 1
#elif defined(LLMCHAT_AVX2_FLOATS)
using llmchat::read_ahead;

// Without AVX-512 the compiler's own loop (rows_plain) widened float16 one value at a time (the
// model's matrices on a Zen 1: 1.8-2.3 GB/s, against 6.4-8.1 here) and bfloat16 rows slower
// (9.6-10.2 GB/s, 10.0-11.6 here).
struct Lanes {  // eight float32 in an AVX2 register
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename W>
  static V load(const W* p) { return llmchat::load8(p); }
  static V xs(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V w, V x, V sum) { return _mm256_fmadd_ps(w, x, sum); }
  static float total(V a, V b) { return llmchat::total8(_mm256_add_ps(a, b)); }
};
#define LLMCHAT_FMA_ROWS 1
#endif

#if defined(LLMCHAT_FMA_ROWS)
// float32, float16 and int8 rows (bfloat16 too without `vdpbf16ps`), two at a time, two
// registers of weights a step widened to float32 against x in float32 (`xf`): four independent
// chains, x read once per pair.
template <typename W, typename X>
void rows_fma(const float* xf, const W* w, X* out, int64_t in, int64_t begin, int64_t end) {
  constexpr int64_t kWidth = Lanes::kWidth, kStep = 2 * kWidth;
  const int64_t full = in - in % kStep;
  int64_t r = begin;
  for (; r + 2 <= end; r += 2) {
    const W* a = w + r * in;
    const W* b = a + in;
    Lanes::V a0 = Lanes::zero(), a1 = Lanes::zero(), b0 = Lanes::zero(), b1 = Lanes::zero();
    for (int64_t k = 0; k < full; k += kStep) {
      const Lanes::V x0 = Lanes::xs(xf + k), x1 = Lanes::xs(xf + k + kWidth);
      read_ahead(a + k, kStep * sizeof(W));
      read_ahead(b + k, kStep * sizeof(W));
      a0 = Lanes::fma(Lanes::load(a + k), x0, a0);
      a1 = Lanes::fma(Lanes::load(a + k + kWidth), x1, a1);
      b0 = Lanes::fma(Lanes::load(b + k), x0, b0);
      b1 = Lanes::fma(Lanes::load(b + k + kWidth), x1, b1);
    }
    float sa = Lanes::total(a0, a1);
    float sb = Lanes::total(b0, b1);
    for (int64_t k = full; k < in; ++k) {
      sa += xf[k] * static_cast<float>(a[k]);
      sb += xf[k] * static_cast<float>(b[k]);
    }
    out[r] = static_cast<X>(sa);
    out[r + 1] = static_cast<X>(sb);
  }
  for (; r < end; ++r) {
    const W* a = w + r * in;
    Lanes::V a0 = Lanes::zero();
    int64_t k = 0;
    for (; k + kWidth <= in; k += kWidth) a0 = Lanes::fma(Lanes::load(a + k), Lanes::xs(xf + k), a0);
    float sa = Lanes::total(a0, Lanes::zero());
    for (; k < in; ++k) sa += xf[k] * static_cast<float>(a[k]);
    out[r] = static_cast<X>(sa);
  }
}
#endif

#if defined(__AVX512BF16__)
inline __m512bh load_bh(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// bfloat16 rows by `vdpbf16ps`, 32 products a step summed in pairs into float32; one row at a
// time with four accumulators (two rows at a time was no faster).
void rows_dpbf16(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t in,
                 int64_t begin, int64_t end) {
  const int64_t full = in - in % 128;
  for (int64_t r = begin; r < end; ++r) {
    const at::BFloat16* a = w + r * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < full; k += 128) {
      read_ahead(a + k, 256);
      a0 = _mm512_dpbf16_ps(a0, load_bh(a + k), load_bh(x + k));
      a1 = _mm512_dpbf16_ps(a1, load_bh(a + k + 32), load_bh(x + k + 32));
      a2 = _mm512_dpbf16_ps(a2, load_bh(a + k + 64), load_bh(x + k + 64));
      a3 = _mm512_dpbf16_ps(a3, load_bh(a + k + 96), load_bh(x + k + 96));
    }
    for (; k + 32 <= in; k += 32) a0 = _mm512_dpbf16_ps(a0, load_bh(a + k), load_bh(x + k));
    float sa = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; k < in; ++k) sa += static_cast<float>(x[k]) * static_cast<float>(a[k]);
    out[r] = static_cast<at::BFloat16>(sa);
  }
}
#endif

#if defined(LLMCHAT_INT_ROWS)
// w8's int8 rows against x rounded to 16 bits, one step for the whole token (`XQuantized`):
// `vpdpwssd` (AVX512-VNNI) multiplies 32 pairs an instruction and sums them in int32, where
// widening each weight to float32 costs three instructions per 16 (rows_fma; this CPU's cores,
// not its memory, were w8's limit: ~13 GB/s against a ~26 GB/s read); with AVX2 only,
// `vpmaddwd` and an add do 16 (rows_madd; ~16 -> ~18.5 GB/s on a Zen 3 EPYC). x's rounding
// error is 1/65534 of its largest value, a hundredth of the weights' own (SmolLM2 against fp32:
// the same top-1 agreement and KL to four decimals; BENCHMARKS.md).
constexpr float kXLevels = 32767.f;

struct XQuantized {
  std::vector<int16_t> q;
  float step = 0.f;  // x ≈ step · q
};

// x rounded to 16 bits over its largest |value|; false (keep float32) for inf or NaN, which
// integers cannot carry. |x| is compared as bits: -ffast-math may drop float checks for them,
// and a non-negative float's bits order as its value does, inf and NaN above all others.
bool quantize_x(const float* x, int64_t in, XQuantized& out) {
  uint32_t largest_bits = 0;
  for (int64_t k = 0; k < in; ++k) {
    uint32_t bits;
    std::memcpy(&bits, x + k, sizeof bits);
    largest_bits = std::max(largest_bits, bits & 0x7fffffffu);
  }
  if (largest_bits >= 0x7f800000u) return false;
  float largest;
  std::memcpy(&largest, &largest_bits, sizeof largest);
  out.q.assign(in, 0);
  out.step = largest / kXLevels;
  if (largest_bits == 0) return true;
  const float inverse = kXLevels / largest;
  for (int64_t k = 0; k < in; ++k) out.q[k] = static_cast<int16_t>(std::nearbyint(x[k] * inverse));
  return true;
}

#endif

#if defined(LLMCHAT_INT_ROWS) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Each int32 lane sums in/32 products of at most 32767 x 128: past this width one could overflow.
constexpr int64_t kMaxIntWidth = 16384;

inline __m512i widen32(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline float reduce(__m512i a, __m512i b) {  // in float32: two int32 lanes' sum may not fit
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b)));
}

void rows_dpwssd(const XQuantized& x, const int8_t* w, float* out, int64_t in, int64_t begin,
                 int64_t end) {
  const int16_t* xq = x.q.data();
  const int64_t full = in - in % 64, pairs = in - in % 32;
  auto tail = [&](const int8_t* row, int64_t from) {
    int64_t sum = 0;
    for (int64_t k = from; k < in; ++k) sum += int64_t{xq[k]} * row[k];
    return static_cast<float>(sum);
  };
  int64_t r = begin;
  for (; r + 2 <= end; r += 2) {
    const int8_t* a = w + r * in;
    const int8_t* b = a + in;
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k < full; k += 64) {
      const __m512i x0 = _mm512_loadu_si512(xq + k), x1 = _mm512_loadu_si512(xq + k + 32);
      read_ahead(a + k, 64);
      read_ahead(b + k, 64);
      a0 = _mm512_dpwssd_epi32(a0, widen32(a + k), x0);
      a1 = _mm512_dpwssd_epi32(a1, widen32(a + k + 32), x1);
      b0 = _mm512_dpwssd_epi32(b0, widen32(b + k), x0);
      b1 = _mm512_dpwssd_epi32(b1, widen32(b + k + 32), x1);
    }
    for (; k < pairs; k += 32) {
      const __m512i x0 = _mm512_loadu_si512(xq + k);
      a0 = _mm512_dpwssd_epi32(a0, widen32(a + k), x0);
      b0 = _mm512_dpwssd_epi32(b0, widen32(b + k), x0);
    }
    out[r] = (reduce(a0, a1) + tail(a, pairs)) * x.step;
    out[r + 1] = (reduce(b0, b1) + tail(b, pairs)) * x.step;
  }
  for (; r < end; ++r) {
    const int8_t* a = w + r * in;
    __m512i a0 = _mm512_setzero_si512();
    for (int64_t k = 0; k < pairs; k += 32) a0 = _mm512_dpwssd_epi32(a0, widen32(a + k), _mm512_loadu_si512(xq + k));
    out[r] = (reduce(a0, _mm512_setzero_si512()) + tail(a, pairs)) * x.step;
  }
}

#define LLMCHAT_INT_ROWS_OF rows_dpwssd
#elif defined(LLMCHAT_INT_ROWS)
// Each int32 lane sums in/16 pairs of products of at most 32767 x 128 (one chain per row).
constexpr int64_t kMaxIntWidth = 4096;

inline __m256i widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float reduce8(__m256i a) {  // in float32: two int32 lanes' sum may not fit
  const __m256 f = _mm256_cvtepi32_ps(a);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// One row at a time, two chains (a step's 32 weights split between them).
void rows_madd(const XQuantized& x, const int8_t* w, float* out, int64_t in, int64_t begin,
               int64_t end) {
  const int16_t* xq = x.q.data();
  const int64_t full = in - in % 32, pairs = in - in % 16;
  for (int64_t r = begin; r < end; ++r) {
    const int8_t* a = w + r * in;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k < full; k += 32) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k + 16));
      s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(widen16(a + k), x0));
      s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(widen16(a + k + 16), x1));
    }
    for (; k < pairs; k += 16) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
      s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(widen16(a + k), x0));
    }
    int64_t sum = 0;
    for (; k < in; ++k) sum += int64_t{xq[k]} * a[k];
    out[r] = (reduce8(s0) + reduce8(s1) + static_cast<float>(sum)) * x.step;
  }
}
#define LLMCHAT_INT_ROWS_OF rows_madd
#endif

#if defined(LLMCHAT_INT_ROWS)
// Whether w8's rows take the integer path: false leaves them to rows_fma / rows_plain.
bool int8_rows(const float* x, const int8_t* w, float* out, int64_t rows, int64_t in) {
  XQuantized xq;
  if (in > kMaxIntWidth || !quantize_x(x, in, xq)) return false;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    LLMCHAT_INT_ROWS_OF(xq, w, out, in, begin, end);
  });
  return true;
}
#else
bool int8_rows(const float*, const int8_t*, float*, int64_t, int64_t) { return false; }
#endif

// Whether W's rows go through rows_fma: all with AVX-512; with AVX2 only, not float32 rows, which
// the compiler's own loop streamed as fast (Zen 1, the model's matrices: 12.9-14.1 GB/s against
// 12.0-12.4, within that machine's noise).
template <typename W>
constexpr bool kFmaRows =
#if defined(__AVX512F__)
    true;
#elif defined(LLMCHAT_FMA_ROWS)
    !std::is_same_v<W, float>;
#else
    false;
#endif

// Whether W's rows are summed against x widened to float32 (rows_fma) rather than x as it is.
template <typename W>
constexpr bool kWidensX =
#if defined(__AVX512BF16__)
    !std::is_same_v<W, at::BFloat16> &&
#endif
    kFmaRows<W>;

template <typename W, typename X>
void matvec_rows(const X* x, const W* w, X* out, int64_t in, int64_t begin, int64_t end,
                 const float* xf) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, at::BFloat16>) {
    rows_dpbf16(x, w, out, in, begin, end);
    return;
  }
#endif
#if defined(LLMCHAT_FMA_ROWS)
  if constexpr (kFmaRows<W>) {
    rows_fma(xf, w, out, in, begin, end);
    return;
  }
#endif
  rows_plain(x, w, out, in, begin, end);
}

// W's rows times x (X: W's own type; float32 for int8 rows, whose scales are applied after).
template <typename W, typename X>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t rows = w.size(0), in = w.size(1);
  const X* xp = x.data_ptr<X>();
  const W* wp = w.data_ptr<W>();
  X* op = out.data_ptr<X>();
  if constexpr (std::is_same_v<W, int8_t>) {
    if (int8_rows(xp, wp, op, rows, in)) return;
  }
  std::vector<float> widened;  // a 16-bit x in float32 once, for the rows that widen theirs
  const float* xf = nullptr;
  if constexpr (std::is_same_v<X, float>) {
    xf = xp;
  } else if constexpr (kWidensX<W>) {
    widened.resize(in);
    for (int64_t k = 0; k < in; ++k) widened[k] = static_cast<float>(xp[k]);
    xf = widened.data();
  }
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    matvec_rows<W, X>(xp, wp, op, in, begin, end, xf);
  });
}

// w4's Q4_0 blocks (engine/quant/w4.py): per row, in / 2 bytes of 4-bit values (value j of a
// block of 32 in byte j's low half, value j + 16 in its high half) and in / 32 float16 scales,
// read as stored. Each block is widened to float32 in registers (GCC's 16-float vector: one
// AVX-512 register, two AVX2 ones) and summed against x as it is, then times its scale: the
// dequantized matrix's product to float32 rounding, its bytes read once.
struct Q4 {
  const uint8_t* q;
  const at::Half* scale;
};

constexpr int64_t kBlock = 32;
using bytes16 = uint8_t __attribute__((vector_size(16)));
using signed16 = int8_t __attribute__((vector_size(16)));
using ints16 = int32_t __attribute__((vector_size(64)));
using floats16 = float __attribute__((vector_size(64)));

inline floats16 load_floats16(const float* p) {
  floats16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A block's 32 values minus 8, in float32: values 0..15 (`low`) and 16..31 (`high`).
inline void widen_block(const uint8_t* p, floats16& low, floats16& high) {
  bytes16 b;
  std::memcpy(&b, p, sizeof b);
  // Through int32 lanes: GCC converts int8 lanes to float one by one, int8 to int32 and int32 to
  // float a register at a time.
  const ints16 low_ints = __builtin_convertvector(reinterpret_cast<signed16>(b & 15) - 8, ints16);
  const ints16 high_ints = __builtin_convertvector(reinterpret_cast<signed16>(b >> 4) - 8, ints16);
  low = __builtin_convertvector(low_ints, floats16);
  high = __builtin_convertvector(high_ints, floats16);
}

// One block's 32 products with x, in 16 lanes (the scale not yet applied).
inline floats16 block_products(const uint8_t* p, const float* x) {
  floats16 low, high;
  widen_block(p, low, high);
  return low * load_floats16(x) + high * load_floats16(x + 16);
}

// One row of x: two chains (even and odd blocks), the scale applied per block.
void rows_q4(const float* x, Q4 w, float* out, int64_t in, int64_t begin, int64_t end) {
  const int64_t blocks = in / kBlock;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* q = w.q + r * (in / 2);
    const at::Half* scale = w.scale + r * blocks;
    floats16 even = {}, odd = {};
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      llmchat::read_ahead(q + b * 16, 32);
      even += block_products(q + b * 16, x + b * kBlock) * static_cast<float>(scale[b]);
      odd += block_products(q + b * 16 + 16, x + b * kBlock + kBlock) * static_cast<float>(scale[b + 1]);
    }
    if (b < blocks) even += block_products(q + b * 16, x + b * kBlock) * static_cast<float>(scale[b]);
    const floats16 total = even + odd;
    float sum = 0.f;
    for (int lane = 0; lane < 16; ++lane) sum += total[lane];
    out[r] = sum;
  }
}

#if defined(LLMCHAT_INT_ROWS)
// With AVX2 or AVX-512, x rounded to 16 bits as w8's rows take it (XQuantized: an error a
// hundredth of the weights' own) and each block summed in integers: its 32 values minus 8 widened
// to int16 and multiplied in pairs by `vpmaddwd`, then to float32 once, times the block's scale.
// About 9 instructions a block where widening to float32 took 15 (rows_q4, which a block of x
// that integers cannot carry still takes).
#if defined(__AVX512BW__)
using q4_lanes = __m512;
inline q4_lanes q4_zero() { return _mm512_setzero_ps(); }
inline q4_lanes q4_scaled(q4_lanes sums, float scale, q4_lanes acc) {
  return _mm512_fmadd_ps(sums, _mm512_set1_ps(scale), acc);
}
inline float q4_total(q4_lanes a) { return _mm512_reduce_add_ps(a); }
inline q4_lanes q4_block(const uint8_t* p, const int16_t* x) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i values = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);  // low halves, high halves
  values = _mm256_sub_epi8(_mm256_and_si256(values, _mm256_set1_epi8(15)), _mm256_set1_epi8(8));
  const __m512i xs = _mm512_loadu_si512(x);
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_cvtepi8_epi16(values), xs));
}

// Two blocks a step (their 32 bytes in one load): both blocks' low halves in one register, their
// high halves in another, x in the matching order (`paired_x`); lanes 0-7 sum block one's products,
// 8-15 block two's, so one conversion and one FMA (against `pair_scales`) serve both: about 13
// instructions for two blocks where q4_block takes 9 for one.
inline __m512 q4_pair(const uint8_t* p, const int16_t* x) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
  const __m256i low = _mm256_sub_epi8(_mm256_and_si256(packed, mask), eight);
  const __m256i high = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), eight);
  const __m512i sums = _mm512_madd_epi16(_mm512_cvtepi8_epi16(low), _mm512_loadu_si512(x));
#if defined(__AVX512VNNI__)
  return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(sums, _mm512_cvtepi8_epi16(high), _mm512_loadu_si512(x + 32)));
#else
  const __m512i more = _mm512_madd_epi16(_mm512_cvtepi8_epi16(high), _mm512_loadu_si512(x + 32));
  return _mm512_cvtepi32_ps(_mm512_add_epi32(sums, more));
#endif
}

// Two blocks' float16 scales as float32: s[0] in lanes 0-7, s[1] in lanes 8-15.
inline __m512 pair_scales(const at::Half* s) {
  int32_t bits;
  std::memcpy(&bits, s, sizeof bits);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_castps128_ps512(two));
}

// x's 16-bit values in q4_pair's order: for each two blocks, the first 16 of one, of the other,
// then the last 16 of each; a last odd block as it is (q4_block's order).
std::vector<int16_t> paired_x(const int16_t* x, int64_t in) {
  std::vector<int16_t> out(x, x + in);
  for (int64_t b = 0; b + 2 <= in / kBlock; b += 2) {
    const int16_t* from = x + b * kBlock;
    int16_t* to = out.data() + b * kBlock;
    std::copy(from + 16, from + 32, to + 32);  // block one's last 16
    std::copy(from + 32, from + 48, to + 16);  // block two's first 16
  }
  return out;
}
#else
using q4_lanes = __m256;
inline q4_lanes q4_zero() { return _mm256_setzero_ps(); }
inline q4_lanes q4_scaled(q4_lanes sums, float scale, q4_lanes acc) {
  return _mm256_fmadd_ps(sums, _mm256_set1_ps(scale), acc);
}
inline float q4_total(q4_lanes f) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline q4_lanes q4_block(const uint8_t* p, const int16_t* x) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  const __m128i low = _mm_sub_epi8(_mm_and_si128(packed, mask), eight);
  const __m128i high = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), eight);
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(low), x0),
                                        _mm256_madd_epi16(_mm256_cvtepi8_epi16(high), x1));
  return _mm256_cvtepi32_ps(sums);
}
#endif

// A row's float16 scales in float32, into `out` [n].
inline void widen_scales(const at::Half* scale, int64_t n, float* out) {
  int64_t b = 0;
#if defined(__F16C__)
  for (; b + 8 <= n; b += 8) {
    _mm256_storeu_ps(out + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + b))));
  }
#endif
  for (; b < n; ++b) out[b] = static_cast<float>(scale[b]);
}

// xq: x's 16-bit values (in paired_x's order with AVX-512), x ≈ step · xq.
// With AVX-512, two blocks a step, their scales converted in registers, and no read-ahead (these
// rows go slowly enough for the CPU's own prefetching; asking 8 KiB ahead cost ~15% here): the
// model's w4 matrices (72 MiB, two threads, a Zen 4, three rounds alternating) 4.3-4.8 ms block by
// block with the read-ahead, 3.5-3.8 ms (20-21.5 GB/s) now.
void rows_q4_int(const int16_t* xq, float step, Q4 w, float* out, int64_t in, int64_t begin, int64_t end) {
  const int64_t blocks = in / kBlock;
#if defined(__AVX512BW__)
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* q = w.q + r * (in / 2);
    const at::Half* scale = w.scale + r * blocks;
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) {
      even = _mm512_fmadd_ps(q4_pair(q + b * 16, xq + b * kBlock), pair_scales(scale + b), even);
      odd = _mm512_fmadd_ps(q4_pair(q + b * 16 + 32, xq + b * kBlock + 2 * kBlock), pair_scales(scale + b + 2), odd);
    }
    if (b + 2 <= blocks) {
      even = _mm512_fmadd_ps(q4_pair(q + b * 16, xq + b * kBlock), pair_scales(scale + b), even);
      b += 2;
    }
    if (b < blocks) even = q4_scaled(q4_block(q + b * 16, xq + b * kBlock), static_cast<float>(scale[b]), even);
    out[r] = q4_total(_mm512_add_ps(even, odd)) * step;
  }
#else
  std::vector<float> scales(blocks);
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* q = w.q + r * (in / 2);
    widen_scales(w.scale + r * blocks, blocks, scales.data());
    q4_lanes even = q4_zero(), odd = q4_zero();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      llmchat::read_ahead(q + b * 16, 32);
      even = q4_scaled(q4_block(q + b * 16, xq + b * kBlock), scales[b], even);
      odd = q4_scaled(q4_block(q + b * 16 + 16, xq + b * kBlock + kBlock), scales[b + 1], odd);
    }
    if (b < blocks) even = q4_scaled(q4_block(q + b * 16, xq + b * kBlock), scales[b], even);
    out[r] = (q4_total(even) + q4_total(odd)) * step;
  }
#endif
}

// One row of x against Q4_0 blocks in integers, where x can be rounded (finite); false otherwise.
bool q4_rows_int(const float* x, Q4 w, float* out, int64_t rows, int64_t in) {
  XQuantized xq;
  if (!quantize_x(x, in, xq)) return false;
#if defined(__AVX512BW__)
  const std::vector<int16_t> ordered = paired_x(xq.q.data(), in);
#else
  const std::vector<int16_t>& ordered = xq.q;
#endif
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    rows_q4_int(ordered.data(), xq.step, w, out, in, begin, end);
  });
  return true;
}
#else
bool q4_rows_int(const float*, Q4, float*, int64_t, int64_t) { return false; }
#endif

// Row r of a Q4_0 matrix in float32, into `row` [in].
inline void widen_row(Q4 w, int64_t r, int64_t in, float* row) {
  const int64_t blocks = in / kBlock;
  const uint8_t* q = w.q + r * (in / 2);
  for (int64_t b = 0; b < blocks; ++b) {
    floats16 low, high;
    widen_block(q + b * 16, low, high);
    const float d = static_cast<float>(w.scale[r * blocks + b]);
    low *= d;
    high *= d;
    std::memcpy(row + b * kBlock, &low, sizeof low);
    std::memcpy(row + b * kBlock + 16, &high, sizeof high);
  }
}

#include "matvec_rows.h"

at::Tensor matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "matvec: W must be a contiguous [out, in] matrix");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 && x.is_contiguous(),
              "matvec: x must be [rows, in], contiguous");
  if (x.size(0) > 1) return matvec_rows_of(x, w);
  const auto wanted = w.scalar_type() == at::kChar ? at::kFloat : w.scalar_type();
  TORCH_CHECK(x.scalar_type() == wanted, "matvec: one row of x comes in W's dtype (float32 for int8 W)");
  at::Tensor out = at::empty({1, w.size(0)}, x.options());
  switch (w.scalar_type()) {
    case at::kFloat: run<float, float>(x, w, out); break;
    case at::kBFloat16: run<at::BFloat16, at::BFloat16>(x, w, out); break;
    case at::kHalf: run<at::Half, at::Half>(x, w, out); break;
    case at::kChar: run<int8_t, float>(x, w, out); break;
    default: TORCH_CHECK(false, "matvec: float32, bfloat16, float16 or int8 W only");
  }
  return out;
}

// The width of a Q4_0 matrix (q uint8 [out, in / 2], scale float16 [out, in / 32]), checked.
int64_t q4_width(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte,
              "matvec_q4: q must be a contiguous uint8 [out, in / 2] matrix");
  const int64_t in = q.size(1) * 2;
  TORCH_CHECK(in % kBlock == 0 && scale.dim() == 2 && scale.is_contiguous() &&
                  scale.scalar_type() == at::kHalf && scale.size(0) == q.size(0) && scale.size(1) == in / kBlock,
              "matvec_q4: a width that is a multiple of 32, and one float16 scale per block of 32");
  return in;
}

// x [n, in] float32 (n up to 16) @ W.T for W in Q4_0 blocks: out [n, out] in float32.
at::Tensor matvec_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const int64_t rows = q.size(0), in = q4_width(q, scale), n = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  n >= 1 && n <= kMaxRows,
              "matvec_q4: x must be [rows, in], contiguous float32, at most 16 rows");
  at::Tensor out = at::empty({n, rows}, x.options());
  const Q4 w{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>()};
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (n == 1 && q4_rows_int(xp, w, op, rows, in)) return out;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    if (n == 1) return rows_q4(xp, w, op, in, begin, end);
    q4_rows_many(xp, n, w, op, rows, in, begin, end);
  });
  return out;
}

// The float32 matrix [out, in] Q4_0 blocks stand for (a prefill's matmul reads it): one pass,
// where torch's ops for the same widening take several.
at::Tensor dequantize_q4(const at::Tensor& q, const at::Tensor& scale) {
  const int64_t rows = q.size(0), in = q4_width(q, scale);
  at::Tensor out = at::empty({rows, in}, q.options().dtype(at::kFloat));
  const Q4 w{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>()};
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) widen_row(w, r, in, op + r * in);
  });
  return out;
}

}  // namespace matvec_kernel

TORCH_LIBRARY_IMPL(llmchat, CPU, m) {
  m.impl("matvec", matvec_kernel::matvec);
  m.impl("matvec_q4", matvec_kernel::matvec_q4);
  m.impl("dequantize_q4", matvec_kernel::dequantize_q4);
}
