// CPU products with weights kept narrow: y[M, N] = x[M, K] . w[N, K]^T, called from jitted code
// through XLA's FFI (runtime/device/cpu_matmul.py builds, loads and calls this file; its jnp
// reference is QuantizedArray.dequantize followed by a dot).
//
// Weights are stored in panels of 16 output channels: panel p holds channels 16p..16p+15, input
// by input (k-major), so one 16-lane vector is one input of 16 channels. Groups of G inputs share
// one f32 scale (and offset) per channel: w[n, k] = q[n, k] * scale[n, k / G] + offset[n, k / G].
//   q [P, K, 16]        I8    int8                (int8 per channel, GGUF Q8_0 / Q5_x / Q6_K)
//                       E4M3  fp8 e4m3fn bytes, read as f16 bits: the value / 2^8 (the caller
//                             folds 2^8 into the scales)
//   q [P, K / 2, 16]    U4    byte: input 2t in the low nibble, 2t + 1 in the high (0..15)
//                       S4    as U4, the value minus 8 (symmetric int4, GGUF Q4_0)
//   q [P, K / 2, 20]    U5    5-bit values (0..31): per input pair 2t, 2t + 1 the 16 bytes of
//                             U4 (the low four bits), then a little-endian 32-bit word of fifth
//                             bits: bit c for input 2t of channel c, bit 16 + c for input 2t + 1
//                       S5    as U5, the value minus 16 (GGUF Q5_0)
//   scale / offset [P, K / G, 16]   f32, or f16 (widened exactly as they are loaded)
// Values are widened in registers (q * scale, then + offset: as the reference widens them), never
// written out. Every output element is one thread's sum over k in order, acc = fma(w_k, x_k, acc),
// whatever the thread count and the number of rows in the product (batch invariant): row tiles
// and the scratch panel of many-row products only share widened weights between elements.
// Threads: cpu_threads.h (as many as XLA's intra-op pool has); the caller works too.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

enum Kind : int32_t { I8 = 0, U4 = 1, S4 = 2, E4M3 = 3, U5 = 4, S5 = 5 };

constexpr bool paired(Kind k) { return k == U4 || k == S4 || k == U5 || k == S5; }
constexpr int64_t pair_bytes(Kind k) { return (k == U5 || k == S5) ? 20 : 16; }

// ------------------------------------------------------------------ 16 f32 lanes

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct V {
  __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vload_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vset(float s) { return {_mm512_set1_ps(s)}; }
inline void vstoreu(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V dec_i8(const uint8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
inline V dec_e4m3(const uint8_t* p) {  // sign << 15 | (exp, mantissa) << 7 as f16
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i m = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(m, 7));
  // e4m3fn's NaN (S.1111.111) as an f16 NaN (exponent all ones)
  __m256i nan = _mm256_cmpeq_epi16(m, _mm256_set1_epi16(0x7F));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
  return {_mm512_cvtph_ps(h)};
}
template <bool kSigned>
inline void dec_4(const uint8_t* p, V& lo, V& hi) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i m = _mm_set1_epi8(0x0F);
  __m512i l = _mm512_cvtepu8_epi32(_mm_and_si128(b, m));
  __m512i h = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m));
  if (kSigned) {
    l = _mm512_sub_epi32(l, _mm512_set1_epi32(8));
    h = _mm512_sub_epi32(h, _mm512_set1_epi32(8));
  }
  lo = {_mm512_cvtepi32_ps(l)};
  hi = {_mm512_cvtepi32_ps(h)};
}
template <bool kSigned>
inline void dec_5(const uint8_t* p, V& lo, V& hi) {  // 16 nibble bytes, then 32 fifth bits
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  uint32_t bits;
  std::memcpy(&bits, p + 16, 4);
  __m128i m = _mm_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi32(16);
  __m512i l = _mm512_cvtepu8_epi32(_mm_and_si128(b, m));
  __m512i h = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m));
  l = _mm512_mask_add_epi32(l, static_cast<__mmask16>(bits), l, sixteen);
  h = _mm512_mask_add_epi32(h, static_cast<__mmask16>(bits >> 16), h, sixteen);
  if (kSigned) {
    l = _mm512_sub_epi32(l, sixteen);
    h = _mm512_sub_epi32(h, sixteen);
  }
  lo = {_mm512_cvtepi32_ps(l)};
  hi = {_mm512_cvtepi32_ps(h)};
}
constexpr const char* kIsa = "avx512";
#else
// Portable: plain loops over 16 lanes, vectorised by the compiler for the host (AVX2, NEON...).
struct V {
  float v[16];
};
inline V vzero() { return V{}; }
inline V vload(const float* p) {
  V r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline V vfma(V a, V b, V c) {
  for (int i = 0; i < 16; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline V vadd(V a, V b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline V vmul(V a, V b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
inline V vset(float s) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = s;
  return r;
}
inline void vstoreu(float* p, V a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V dec_i8(const uint8_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return r;
}
inline float half_to_float(uint16_t h) {
  uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float mag = e == 0x1F ? (m ? __builtin_nanf("") : __builtin_inff())
              : e ? __builtin_ldexpf(static_cast<float>(m | 0x400), static_cast<int>(e) - 25)
                  : __builtin_ldexpf(static_cast<float>(m), -24);
  return (h & 0x8000) ? -mag : mag;
}
inline V vload_half(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = half_to_float(p[i]);
  return r;
}
inline V dec_e4m3(const uint8_t* p) {
  V r;
  for (int i = 0; i < 16; ++i)
    r.v[i] = (p[i] & 0x7F) == 0x7F  // e4m3fn's NaN
                 ? __builtin_nanf("")
                 : half_to_float(static_cast<uint16_t>(((p[i] & 0x80) << 8) | ((p[i] & 0x7F) << 7)));
  return r;
}
template <bool kSigned>
inline void dec_4(const uint8_t* p, V& lo, V& hi) {
  const int bias = kSigned ? 8 : 0;
  for (int i = 0; i < 16; ++i) {
    lo.v[i] = static_cast<float>((p[i] & 0x0F) - bias);
    hi.v[i] = static_cast<float>((p[i] >> 4) - bias);
  }
}
template <bool kSigned>
inline void dec_5(const uint8_t* p, V& lo, V& hi) {
  uint32_t bits;
  std::memcpy(&bits, p + 16, 4);
  const int bias = kSigned ? 16 : 0;
  for (int i = 0; i < 16; ++i) {
    lo.v[i] = static_cast<float>(((p[i] & 0x0F) | (((bits >> i) & 1) << 4)) - bias);
    hi.v[i] = static_cast<float>(((p[i] >> 4) | (((bits >> (16 + i)) & 1) << 4)) - bias);
  }
}
constexpr const char* kIsa = "portable";
#endif

// ------------------------------------------------------------------ the product

struct Problem {
  const float* x;       // [M, K]
  const uint8_t* q;     // [P, panel bytes]
  const void* scale;    // [P, K / G, 16] f32 or f16
  const void* offset;   // [P, K / G, 16] (the scale's dtype) or null
  float* y;             // [M, 16 P]
  int64_t m, n, k, g, panel_bytes;
};

template <Kind kKind>
constexpr int kStep = paired(kKind) ? 2 : 1;  // inputs per load

// Inputs k (and k + 1 for 4-bit, in w[1]) of panel `pq` widened, with its group's scales sv and
// offsets ov (16 channels).
template <Kind kKind, bool kOffset>
inline void widen(const uint8_t* pq, int64_t k, V sv, V ov, V* w) {
  if constexpr (kKind == U4 || kKind == S4) {
    dec_4<kKind == S4>(pq + k / 2 * 16, w[0], w[1]);
    w[1] = vmul(w[1], sv);
  } else if constexpr (kKind == U5 || kKind == S5) {
    dec_5<kKind == S5>(pq + k / 2 * 20, w[0], w[1]);
    w[1] = vmul(w[1], sv);
  } else if constexpr (kKind == I8) {
    w[0] = dec_i8(pq + k * 16);
  } else {
    w[0] = dec_e4m3(pq + k * 16);
  }
  w[0] = vmul(w[0], sv);
  if constexpr (kOffset) {
    w[0] = vadd(w[0], ov);
    if constexpr (paired(kKind)) w[1] = vadd(w[1], ov);
  }
}

// Group j's scales (or offsets) of panel `panel` (16 channels) as f32; zeros when `a` is null.
template <bool kHalf>
inline V group_factors(const void* a, const Problem& p, int64_t panel, int64_t j) {
  if (!a) return vzero();
  const int64_t at = (panel * (p.k / p.g) + j) * 16;
  if constexpr (kHalf) return vload_half(static_cast<const uint16_t*>(a) + at);
  else return vload(static_cast<const float*>(a) + at);
}

// Few rows: rows r0..r0+R x panels p0..p0+NP, the weights widened in registers.
template <int R, int NP, Kind kKind, bool kOffset, bool kHalf>
inline void tile_direct(const Problem& p, int64_t r0, int64_t p0) {
  constexpr int step = kStep<kKind>;
  V acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) acc[r][c] = vzero();
  for (int64_t j = 0; j < p.k / p.g; ++j) {
    V s[NP], o[NP];
    for (int c = 0; c < NP; ++c) {
      s[c] = group_factors<kHalf>(p.scale, p, p0 + c, j);
      o[c] = group_factors<kHalf>(p.offset, p, p0 + c, j);
    }
    for (int64_t k = j * p.g; k < (j + 1) * p.g; k += step) {
      V w[NP][2];
      for (int c = 0; c < NP; ++c)
        widen<kKind, kOffset>(p.q + (p0 + c) * p.panel_bytes, k, s[c], o[c], w[c]);
      for (int i = 0; i < step; ++i)
        for (int r = 0; r < R; ++r) {
          const V xv = vset(p.x[(r0 + r) * p.k + k + i]);
          for (int c = 0; c < NP; ++c) acc[r][c] = vfma(w[c][i], xv, acc[r][c]);
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) vstoreu(p.y + (r0 + r) * p.n + (p0 + c) * 16, acc[r][c]);
}

// Many rows: panels p0..p0+NP widened once into `wide` [NP, K, 16], then row tiles of R.
template <int R, int NP>
inline void tile_wide(const Problem& p, const float* wide, int64_t r0, int64_t p0) {
  V acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < p.k; ++k) {
    V w[NP];
    for (int c = 0; c < NP; ++c) w[c] = vload(wide + (c * p.k + k) * 16);
    for (int r = 0; r < R; ++r) {
      const V xv = vset(p.x[(r0 + r) * p.k + k]);
      for (int c = 0; c < NP; ++c) acc[r][c] = vfma(w[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) vstoreu(p.y + (r0 + r) * p.n + (p0 + c) * 16, acc[r][c]);
}

constexpr int64_t kWideRows = 16;  // from this many rows, widen each panel pair once

template <int NP>
inline void rows_wide(const Problem& p, const float* wide, int64_t c) {
  int64_t r = 0;
  for (; r + 12 <= p.m; r += 12) tile_wide<12, NP>(p, wide, r, c);
  for (; r + 4 <= p.m; r += 4) tile_wide<4, NP>(p, wide, r, c);
  for (; r < p.m; ++r) tile_wide<1, NP>(p, wide, r, c);
}

template <Kind kKind, bool kOffset, bool kHalf>
void run_panels(const Problem& p, int64_t a, int64_t b) {
  constexpr int step = kStep<kKind>;
  if (p.m < kWideRows) {
    int64_t c = a;
    for (; c + 4 <= b; c += 4) {  // a chunk is whole groups of 4 panels but the last
      int64_t r = 0;
      for (; r + 4 <= p.m; r += 4) {
        tile_direct<4, 2, kKind, kOffset, kHalf>(p, r, c);
        tile_direct<4, 2, kKind, kOffset, kHalf>(p, r, c + 2);
      }
      for (; r + 2 <= p.m; r += 2) tile_direct<2, 4, kKind, kOffset, kHalf>(p, r, c);
      for (; r < p.m; ++r) tile_direct<1, 4, kKind, kOffset, kHalf>(p, r, c);
    }
    for (; c < b; ++c)
      for (int64_t r = 0; r < p.m; ++r) tile_direct<1, 1, kKind, kOffset, kHalf>(p, r, c);
    return;
  }
  thread_local std::vector<float> wide;
  wide.resize(2 * p.k * 16);
  for (int64_t c = a; c < b; c += 2) {
    const int np = std::min<int64_t>(2, b - c);
    for (int i = 0; i < np; ++i)
      for (int64_t j = 0; j < p.k / p.g; ++j) {
        const V s = group_factors<kHalf>(p.scale, p, c + i, j);
        const V o = group_factors<kHalf>(p.offset, p, c + i, j);
        for (int64_t k = j * p.g; k < (j + 1) * p.g; k += step) {
          V w[2];
          widen<kKind, kOffset>(p.q + (c + i) * p.panel_bytes, k, s, o, w);
          for (int t = 0; t < step; ++t) vstoreu(wide.data() + (i * p.k + k + t) * 16, w[t]);
        }
      }
    if (np == 2) rows_wide<2>(p, wide.data(), c);
    else rows_wide<1>(p, wide.data(), c);
  }
}

using PanelsFn = void (*)(const Problem&, int64_t, int64_t);

template <Kind kKind>
PanelsFn pick_kind(bool offset, bool half) {
  if (half) return offset ? run_panels<kKind, true, true> : run_panels<kKind, false, true>;
  return offset ? run_panels<kKind, true, false> : run_panels<kKind, false, false>;
}

PanelsFn pick(Kind kind, bool offset, bool half) {
  switch (kind) {
    case I8: return pick_kind<I8>(offset, half);
    case U4: return pick_kind<U4>(offset, half);
    case S4: return pick_kind<S4>(offset, half);
    case U5: return pick_kind<U5>(offset, half);
    case S5: return pick_kind<S5>(offset, half);
    case E4M3: return pick_kind<E4M3>(offset, half);
  }
  return nullptr;
}

// ------------------------------------------------------------------ threads

// Below this much work (weight bytes read + 4 x multiply-adds) a product runs on the calling
// thread: waking a helper costs more than it saves.
constexpr int64_t kThreadedWork = 1 << 20;

void run(ffi::ThreadPool& pool, const Problem& p, PanelsFn fn) {
  const int64_t panels = p.n / 16;
  const int64_t work = panels * p.panel_bytes + 4 * p.m * p.n * p.k;
  // as many threads as XLA's intra-op pool has (the host's cores, or fewer when pinned)
  const int64_t threads = work < kThreadedWork ? 1 : std::max<int64_t>(1, pool.num_threads());
  // several chunks per thread (so a late helper still helps), of whole groups of 4 panels
  const int64_t want = threads == 1 ? 1 : threads * 4;
  const int64_t chunk = std::max<int64_t>(4, (panels + want - 1) / want + 3) / 4 * 4;
  const int64_t chunks = (panels + chunk - 1) / chunk;
  if (threads == 1 || chunks == 1) {
    fn(p, 0, panels);
    return;
  }
  jaxinfer_cpu::helpers().parallel(chunks, threads, [&](int64_t c) {
    fn(p, c * chunk, std::min(panels, (c + 1) * chunk));
  });
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                   ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y,
                   int32_t kind, int64_t group) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(),
             yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: x, q, scale and y must be 2-D");
  Problem p{};
  p.m = xd[0];
  p.k = xd[1];
  p.n = yd[1];
  p.g = group;
  const Kind kd = static_cast<Kind>(kind);
  if (kd < I8 || kd > S5) return ffi::Error::InvalidArgument("jaxinfer_qmatmul: unknown kind");
  const ffi::DataType st = scale.element_type();
  if (st != ffi::DataType::F32 && st != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: scales must be f32 or f16");
  const bool two = paired(kd);
  p.panel_bytes = two ? pair_bytes(kd) * (p.k / 2) : 16 * p.k;
  if (p.g <= 0 || p.k % p.g || (two && p.g % 2))
    return ffi::Error::InvalidArgument(
        "jaxinfer_qmatmul: the group must divide K (evenly for 4- and 5-bit)");
  const int64_t groups = p.k / p.g;
  const int64_t q_bytes = qd[1] * static_cast<int64_t>(ffi::ByteWidth(q.element_type()));
  if (yd[0] != p.m || p.n % 16 || qd[0] * 16 != p.n || q_bytes != p.panel_bytes ||
      sd[0] * 16 != p.n || sd[1] != groups * 16)
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: weight shapes do not match x and y");
  const bool has_offset = offset.element_count() > 0;
  if (has_offset && (static_cast<int64_t>(offset.element_count()) != p.n * groups ||
                     offset.element_type() != st))
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: offsets must match the scales");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.x = x.typed_data();
  p.q = static_cast<const uint8_t*>(q.untyped_data());
  p.scale = scale.untyped_data();
  p.offset = has_offset ? offset.untyped_data() : nullptr;
  p.y = y->typed_data();
  run(pool, p, pick(kd, has_offset, st == ffi::DataType::F16));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQMatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // q [P, panel bytes / itemsize]
                                  .Arg<ffi::AnyBuffer>()         // scale f32|f16 [P, K / G * 16]
                                  .Arg<ffi::AnyBuffer>()         // offset like scale, or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, 16 P]
                                  .Attr<int32_t>("kind")
                                  .Attr<int64_t>("group"));

extern "C" const char* jaxinfer_cpu_matmul_isa() { return kIsa; }
