// Part of matvec.cpp (included there once, after what it reads), kept apart for its size.
// Several rows of x at once (a speculative verify's K+1 tokens, the lab's batch of decodes, a
// short prefill): each weight row is read from memory once for every row of x, so up to kMaxRows
// rows cost about the bytes of one. What is left is the products, n per weight, and they are
// arranged so the cores' multipliers, not their loads, set the pace: a tile of kTileW weight
// rows times kTileX rows of x keeps its kTileW x kTileX sums in registers, each weight widened
// once per tile and each x vector loaded once for kTileW rows. With AVX-512, each product is the
// widest the CPU has: 16 float32 FMAs against float32 x; where x is bfloat16 as W is (a bf16 model's
// activations), 32 pairs by `vdpbf16ps`, as the one-row path multiplies; for w8's int8 rows, x
// rounded to 16 bits per row as the one-row path rounds it (XQuantized) and 32 pairs summed in
// integers by `vpdpwssd` (16 by `vpmaddwd` with AVX2 only). With AVX2 only, 16-bit rows go 8 wide
// in the same tiles and float32 rows take the portable loop below (run_many says why). Before the
// tiles, sums went 8 floats wide against each weight row widened into memory, and a bf16 model's
// rows went to torch's matmul: 9 rows cost 2.0-3.1 one-row steps, then 1.7-1.8 with tiles of 4
// rows of x, 1.3 (float32) with tiles of up to 10 (AVX-512 EPYCs; BENCHMARKS.md). matvec.cpp
// defines what it reads (Q4, widen_row, quantize_x, the int8 helpers).

constexpr int64_t kMaxRows = 16;

// The tile: kTileW weight rows x up to P::kTileX rows of x, its sums plus the weights and one x
// vector in registers. With AVX2's 16 registers, 2 x 4 (11 of them). With AVX-512's 32, float32
// and 16-bit rows take 2 x up to 10 (23), so that a verify's 5-9 rows take one tile: each weight
// read once, while the next ones arrive. The model's matrices, in ms (the Zen 4 EPYC, best of 15,
// 3 rounds alternating), 5, 9 and 16 rows of x: float32 2 x 4 (as before) 20.1-21.1, 31.7-32.5,
// 52.6-53.3; 4 x 4 18.4-23.1, 26.1-32.3, 37.0-46.3; 2 x 8 17.5-20.1, 27.2-32.1, 37.1-45.5;
// 2 x 10 17.8-18.8, 21.1-21.5, 36.2-37.2 (one row 14-18); bfloat16 9 rows 12.7-13.6 -> 11.0-11.9.
// w8's int8 rows stay at 2 x 4: 2 x 10 took 9 rows from 10.7-14.1 to 14.3-18.3 (best of 21).
#ifndef LLMCHAT_TILE_W  // other shapes to compare: LLMCHAT_KERNEL_CFLAGS="-DLLMCHAT_TILE_W=4 ..."
#define LLMCHAT_TILE_W 2
#endif
#ifndef LLMCHAT_TILE_X
#if defined(__AVX512F__)
#define LLMCHAT_TILE_X 10
#else
#define LLMCHAT_TILE_X 4
#endif
#endif
constexpr int kTileW = LLMCHAT_TILE_W, kFloatTileX = LLMCHAT_TILE_X;

// How one kind of row is multiplied, kStep weights at a time: Weights (kStep weights in a
// register), XV (kStep of x's values), Sum (a tile entry's partial sums), and their total; kTileX,
// the most rows of x a tile takes.
#if defined(LLMCHAT_FMA_ROWS)
template <typename W>
struct FloatProducts {  // float32, bfloat16, float16 or int8 rows widened in a register; float32 x
  using X = float;
  using Sum = Lanes::V;
  using Weights = Lanes::V;
  using XV = Lanes::V;
  static constexpr int64_t kStep = Lanes::kWidth;
  static constexpr int kTileX = kFloatTileX;
  static Sum zero() { return Lanes::zero(); }
  static Weights weights(const W* p) { return Lanes::load(p); }
  static XV xs(const X* p) { return Lanes::xs(p); }
  static Sum add(Sum s, Weights w, XV x) { return Lanes::fma(w, x, s); }
  static float total(Sum s) { return Lanes::total(s, Lanes::zero()); }
};
#endif

#if defined(__AVX512BF16__)
struct Bf16Products {  // bfloat16 rows and x, in pairs into float32
  using X = at::BFloat16;
  using Sum = __m512;
  using Weights = __m512bh;
  using XV = __m512bh;
  static constexpr int64_t kStep = 32;
  static constexpr int kTileX = kFloatTileX;
  static Sum zero() { return _mm512_setzero_ps(); }
  static Weights weights(const at::BFloat16* p) { return load_bh(p); }
  static XV xs(const X* p) { return load_bh(p); }
  static Sum add(Sum s, Weights w, XV x) { return _mm512_dpbf16_ps(s, w, x); }
  static float total(Sum s) { return _mm512_reduce_add_ps(s); }
};
#endif

#if defined(LLMCHAT_INT_ROWS)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct Int8Products {  // int8 rows widened to int16, x's 16-bit values, pairs summed in int32
  using X = int16_t;
  using Sum = __m512i;
  using Weights = __m512i;
  using XV = __m512i;
  static constexpr int64_t kStep = 32;
  static constexpr int kTileX = 4;  // wider tiles were slower (see kFloatTileX)
  static Sum zero() { return _mm512_setzero_si512(); }
  static Weights weights(const int8_t* p) { return widen32(p); }
  static XV xs(const X* p) { return _mm512_loadu_si512(p); }
  static Sum add(Sum s, Weights w, XV x) { return _mm512_dpwssd_epi32(s, w, x); }
  static float total(Sum s) { return reduce(s, _mm512_setzero_si512()); }
};
#else
struct Int8Products {
  using X = int16_t;
  using Sum = __m256i;
  using Weights = __m256i;
  using XV = __m256i;
  static constexpr int64_t kStep = 16;
  static constexpr int kTileX = 4;
  static Sum zero() { return _mm256_setzero_si256(); }
  static Weights weights(const int8_t* p) { return widen16(p); }
  static XV xs(const X* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Sum add(Sum s, Weights w, XV x) { return _mm256_add_epi32(s, _mm256_madd_epi16(w, x)); }
  static float total(Sum s) { return reduce8(s); }
};
#endif
// Each int32 lane sums 2 · in / kStep products of at most 32767 x 128 (< 2^22): 512 fit.
constexpr int64_t kMaxIntRowsWidth = 256 * Int8Products::kStep;
#endif

// What a tile writes: x row j's sum for W's row r, times x row j's step where x was rounded to
// integers (`step`, else nullptr), in out's type.
template <typename O>
struct Outputs {
  O* out;
  int64_t rows;
  const float* step;
  void put(int64_t j, int64_t r, float sum) const {
    out[j * rows + r] = static_cast<O>(step == nullptr ? sum : sum * step[j]);
  }
};

// Rows r..r+R-1 of W (`block`, rows `in` apart) times x rows j..j+G-1, into `to`. The first tile
// over these weight rows reads them from memory (and asks for what follows); the others find them
// in L1.
template <typename P, int R, int G, typename W, typename O>
inline void tile(const typename P::X* x, const W* block, const Outputs<O>& to, int64_t in, int64_t r, int64_t j,
                 bool first) {
  const int64_t full = in - in % P::kStep;
  typename P::Sum sums[R][G];
#pragma GCC unroll 16
  for (int a = 0; a < R; ++a)
#pragma GCC unroll 16
    for (int b = 0; b < G; ++b) sums[a][b] = P::zero();
  for (int64_t k = 0; k < full; k += P::kStep) {
    typename P::Weights weights[R];
#pragma GCC unroll 16
    for (int a = 0; a < R; ++a) {
      if (first) llmchat::read_ahead(block + a * in + k, P::kStep * sizeof(W));
      weights[a] = P::weights(block + a * in + k);
    }
#pragma GCC unroll 16
    for (int b = 0; b < G; ++b) {
      const typename P::XV xv = P::xs(x + (j + b) * in + k);
#pragma GCC unroll 16
      for (int a = 0; a < R; ++a) sums[a][b] = P::add(sums[a][b], weights[a], xv);
    }
  }
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < G; ++b) {
      float sum = P::total(sums[a][b]);
      for (int64_t k = full; k < in; ++k) sum += static_cast<float>(x[(j + b) * in + k]) * static_cast<float>(block[a * in + k]);
      to.put(j + b, r + a, sum);
    }
  }
}

// A tile of g rows of x (1 <= g <= P::kTileX), g chosen at run time.
template <typename P, int R, int G = 1, typename W, typename O>
inline void tile_of(int64_t g, const typename P::X* x, const W* block, const Outputs<O>& to, int64_t in, int64_t r,
                    int64_t j, bool first) {
  if constexpr (G <= P::kTileX) {
    if (g == G) return tile<P, R, G>(x, block, to, in, r, j, first);
    tile_of<P, R, G + 1>(g, x, block, to, in, r, j, first);
  }
}

// R rows of W (from `block`) times all n rows of x, in as few tiles as hold them, as equal as they
// come: 5 rows of int8 tiles as 3 + 2 (6.9-8.2 ms, the model's matrices, best of 31, 4 rounds
// alternating) rather than 4 + 1 (7.4-9.3), 12 rows of bfloat16 as 6 + 6 (14.8-15.7) rather than
// 10 + 2 (16.9-17.8).
template <typename P, int R, typename W, typename O>
void rows_times_x(const typename P::X* x, int64_t n, const W* block, const Outputs<O>& to, int64_t in, int64_t r) {
  const int64_t tiles = (n + P::kTileX - 1) / P::kTileX;
  for (int64_t t = 0, j = 0; t < tiles; ++t) {
    const int64_t g = n / tiles + (t < n % tiles ? 1 : 0);
    tile_of<P, R>(g, x, block, to, in, r, j, t == 0);
    j += g;
  }
}

// W's rows begin..end times x's n rows, kTileW weight rows at a time.
template <typename P, typename W, typename O>
void rows_many(const typename P::X* x, int64_t n, const W* w, const Outputs<O>& to, int64_t in, int64_t begin,
               int64_t end) {
  int64_t r = begin;
  for (; r + kTileW <= end; r += kTileW) rows_times_x<P, kTileW>(x, n, w + r * in, to, in, r);
  for (; r < end; ++r) rows_times_x<P, 1>(x, n, w + r * in, to, in, r);
}

#if !defined(__AVX512F__)
// The portable product of float rows: 8 floats at a time (GCC's vector type: one AVX2 register)
// against W's row widened to float32 in memory once for all n rows of x.
using float8 = float __attribute__((vector_size(32)));

inline float8 load_float8(const float* p) {
  float8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int N>
void sums_of_row(const float* xf, const float* row, float* out, int64_t rows, int64_t in, int64_t r) {
  const int64_t full = in - in % 8;
  float8 sums[N] = {};
  for (int64_t k = 0; k < full; k += 8) {
    const float8 weights = load_float8(row + k);
    for (int j = 0; j < N; ++j) sums[j] += load_float8(xf + j * in + k) * weights;
  }
  for (int j = 0; j < N; ++j) {
    float sum = 0.f;
    for (int lane = 0; lane < 8; ++lane) sum += sums[j][lane];
    for (int64_t k = full; k < in; ++k) sum += xf[j * in + k] * row[k];
    out[j * rows + r] = sum;
  }
}

template <int N = 2>
void sums_of_row_n(int64_t n, const float* xf, const float* row, float* out, int64_t rows, int64_t in, int64_t r) {
  if constexpr (N <= kMaxRows) {
    if (n == N) return sums_of_row<N>(xf, row, out, rows, in, r);
    sums_of_row_n<N + 1>(n, xf, row, out, rows, in, r);
  }
}

template <typename W>
void rows_many_portable(const float* x, int64_t n, const W* w, const Outputs<float>& to, int64_t in,
                        int64_t begin, int64_t end) {
  std::vector<float> widened(std::is_same_v<W, float> ? 0 : in);
  for (int64_t r = begin; r < end; ++r) {
    const W* source = w + r * in;
    const float* row = reinterpret_cast<const float*>(source);
    if constexpr (!std::is_same_v<W, float>) {
      for (int64_t k = 0; k < in; ++k) widened[k] = static_cast<float>(source[k]);
      row = widened.data();
    }
    sums_of_row_n(n, x, row, to.out, to.rows, in, r);
  }
}
#endif

#if defined(LLMCHAT_INT_ROWS)
// x's n rows, each rounded to 16 bits over its own largest |value| (as one row is).
struct XRowsQuantized {
  std::vector<int16_t> q;  // [n, in]
  std::vector<float> step;  // [n]
};

// false (keep float32) where a row holds inf or NaN, or the rows are too wide for int32 sums.
bool quantize_rows(const float* x, int64_t n, int64_t in, XRowsQuantized& out) {
  if (in > kMaxIntRowsWidth) return false;
  out.q.resize(n * in);
  out.step.resize(n);
  XQuantized row;
  for (int64_t j = 0; j < n; ++j) {
    if (!quantize_x(x + j * in, in, row)) return false;
    std::copy(row.q.begin(), row.q.end(), out.q.begin() + j * in);
    out.step[j] = row.step;
  }
  return true;
}

// Whether w8's rows took the integer path for x's n rows: false leaves them to the float one.
bool int8_rows_many(const float* x, const int8_t* w, float* out, int64_t n, int64_t rows, int64_t in) {
  XRowsQuantized xq;
  if (!quantize_rows(x, n, in, xq)) return false;
  const Outputs<float> to{out, rows, xq.step.data()};
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    rows_many<Int8Products>(xq.q.data(), n, w, to, in, begin, end);
  });
  return true;
}
#else
bool int8_rows_many(const float*, const int8_t*, float*, int64_t, int64_t, int64_t) { return false; }
#endif

// A Q4_0 matrix's rows times x's n float32 rows: kTileW rows at a time widened to float32 (in L1)
// for all of them.
void q4_rows_many(const float* x, int64_t n, Q4 w, float* out, int64_t rows, int64_t in, int64_t begin, int64_t end) {
  std::vector<float> widened(kTileW * in);
  const Outputs<float> to{out, rows, nullptr};
  for (int64_t r = begin; r < end; r += kTileW) {
    const int64_t count = std::min<int64_t>(kTileW, end - r);
    for (int64_t a = 0; a < count; ++a) widen_row(w, r + a, in, widened.data() + a * in);
#if defined(__AVX512F__)
    if (count == kTileW) {
      rows_times_x<FloatProducts<float>, kTileW>(x, n, widened.data(), to, in, r);
      continue;
    }
    for (int64_t a = 0; a < count; ++a) rows_times_x<FloatProducts<float>, 1>(x, n, widened.data() + a * in, to, in, r + a);
#else
    for (int64_t a = 0; a < count; ++a) sums_of_row_n(n, x, widened.data() + a * in, out, rows, in, r + a);
#endif
  }
}

// W's rows times each of x's n float32 rows: out [n, rows] in float32 (int8 rows' scales are
// applied after).
template <typename W>
void run_many(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t n = x.size(0), rows = w.size(0), in = w.size(1);
  const float* xp = x.data_ptr<float>();
  const W* wp = w.data_ptr<W>();
  float* op = out.data_ptr<float>();
  if constexpr (std::is_same_v<W, int8_t>) {
    if (int8_rows_many(xp, wp, op, n, rows, in)) return;
  }
  const Outputs<float> to{op, rows, nullptr};
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    rows_many<FloatProducts<W>>(xp, n, wp, to, in, begin, end);
#elif defined(LLMCHAT_FMA_ROWS)
    // 16-bit rows widened in a register, not into memory first: a bf16 verify of 2-3 rows went
    // from 1.2 to 0.9-1.0 one-row steps, 16 rows 3.0 -> 2.5 (Zen 1). float32 rows keep the portable
    // loop, whose one sum per row of x (up to 16 chains) ran 5 and 9 rows in 1.2 and 1.35 steps
    // where these tiles took 1.35 and 1.7: a tile's leftover row of x is two chains, one FMA's
    // latency each.
    if constexpr (std::is_same_v<W, float>) {
      rows_many_portable(xp, n, wp, to, in, begin, end);
    } else {
      rows_many<FloatProducts<W>>(xp, n, wp, to, in, begin, end);
    }
#else
    rows_many_portable(xp, n, wp, to, in, begin, end);
#endif
  });
}

// n bfloat16 rows of x against bfloat16 W, out [n, rows] in bfloat16; false where the CPU has no
// `vdpbf16ps` (then x is widened and the float32 sums rounded).
bool bf16_rows_many(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
#if defined(__AVX512BF16__)
  const int64_t n = x.size(0), rows = w.size(0), in = w.size(1);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const Outputs<at::BFloat16> to{out.data_ptr<at::BFloat16>(), rows, nullptr};
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    rows_many<Bf16Products>(xp, n, wp, to, in, begin, end);
  });
  return true;
#else
  return false;
#endif
}

// x [n, in] @ W.T for 2 <= n <= kMaxRows: x float32 (any W; out float32), or x in W's own 16-bit
// dtype (out in it, as one row's is).
at::Tensor matvec_rows_of(const at::Tensor& x, const at::Tensor& w) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.size(0) <= kMaxRows && (dtype == at::kFloat || (dtype == w.scalar_type() && dtype != at::kChar)),
              "matvec: several rows of x come as float32 or in W's 16-bit dtype, at most 16 of them");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  if (dtype == at::kBFloat16 && bf16_rows_many(x, w, out)) return out;
  if (dtype != at::kFloat) return matvec_rows_of(x.to(at::kFloat), w).to(dtype);
  switch (w.scalar_type()) {
    case at::kFloat: run_many<float>(x, w, out); break;
    case at::kBFloat16: run_many<at::BFloat16>(x, w, out); break;
    case at::kHalf: run_many<at::Half>(x, w, out); break;
    case at::kChar: run_many<int8_t>(x, w, out); break;
    default: TORCH_CHECK(false, "matvec: float32, bfloat16, float16 or int8 W only");
  }
  return out;
}
