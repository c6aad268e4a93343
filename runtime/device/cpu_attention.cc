// Ragged paged attention on CPU, called from jitted code through XLA's FFI for decode steps
// (runtime/device/attention.py `cpu_paged_attention`; its reference is the XLA path beside it,
// `xla_ragged_paged_attention`). Reads K and V straight from their pages: no gathered copy, no
// padded tiles, work in proportion to the live rows and their lengths.
//
//   q        f32 [T, Hq, Dh]        rows of sequence s: cu_q_lens[s] .. cu_q_lens[s + 1]
//   k, v     f32 [Hkv, N, ps, Dh]   page n, slot o holds position page_indices[s, i] * ps + o
//   kv_lens  i32 [S]   page_indices i32 [S, P]   cu_q_lens i32 [S + 1]   num_seqs i32 [1]
//   sinks    f32 [Hq] (a logit per head in every softmax, value 0) or [0]
//   out      f32 [T, Hq, Dh]        rows of no sequence: 0
// Row j of sequence s sits at position kv_len - q_len + j and sees the positions <= its own
// (and > its own - window with a sliding window). Scores: q . k * sm_scale, then
// cap * tanh(score / cap) with a soft cap. One work item is a (row, KV head) pair: its G query
// heads share each K/V row read; each item is summed by one thread in position order, so the
// result does not depend on the thread count or on the other rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_threads.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Attn {
  const float *q, *k, *v, *sinks;
  const int32_t *kv_lens, *pages, *cu, *row_seq;
  float* out;
  int64_t t, hq, hkv, dh, n_pages, ps, p_width, window;
  float sm_scale, soft_cap;
};

// sum_d a[d] b[d] over 16 independent lanes (lane l: d = l, l + 16, ...; fused multiply-adds
// with AVX-512), the lanes then added as a fixed tree: the same order at every call.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
#else
  float lanes[16] = {};
  for (; d + 16 <= n; d += 16)
    for (int i = 0; i < 16; ++i) lanes[i] = __builtin_fmaf(a[d + i], b[d + i], lanes[i]);
#endif
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
  s = (h4[0] + h4[2]) + (h4[1] + h4[3]);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline const float* slot(const Attn& a, const float* pool, int64_t h, int64_t seq, int64_t pos) {
  int64_t page = a.pages[seq * a.p_width + pos / a.ps];
  if (page < 0 || page >= a.n_pages) page = 0;  // a bad index reads the null page, never outside
  return pool + ((h * a.n_pages + page) * a.ps + pos % a.ps) * a.dh;
}

// Row `row`, KV head `h`: its G query heads over their visible positions.
void item(const Attn& a, int64_t row, int64_t h) {
  thread_local std::vector<float> scores;  // [G, n] scores, then [G] denominators
  const int64_t g = a.hq / a.hkv;
  float* out = a.out + (row * a.hq + h * g) * a.dh;
  const int32_t s = a.row_seq[row];
  if (s < 0) {
    std::memset(out, 0, sizeof(float) * g * a.dh);
    return;
  }
  const int64_t kv_len = a.kv_lens[s], q_len = a.cu[s + 1] - a.cu[s];
  const int64_t pos = kv_len - q_len + (row - a.cu[s]);
  const int64_t hi = std::min<int64_t>(pos + 1, kv_len);
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  const int64_t n = std::max<int64_t>(0, hi - lo);
  scores.resize(g * n + g);
  for (int64_t i = 0; i < n; ++i) {
    const float* kr = slot(a, a.k, h, s, lo + i);
    for (int64_t j = 0; j < g; ++j) {
      float sc = dot(a.q + (row * a.hq + h * g + j) * a.dh, kr, a.dh) * a.sm_scale;
      if (a.soft_cap > 0.f) sc = a.soft_cap * std::tanh(sc / a.soft_cap);
      scores[j * n + i] = sc;
    }
  }
  std::memset(out, 0, sizeof(float) * g * a.dh);
  float* den = scores.data() + g * n;
  for (int64_t j = 0; j < g; ++j) {
    float* sc = scores.data() + j * n;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sc[i]);
    const float sink = a.sinks ? a.sinks[h * g + j] : -INFINITY;
    mx = std::max(mx, sink);
    float sum = a.sinks ? std::exp(sink - mx) : 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sc[i] = std::exp(sc[i] - mx);
      sum += sc[i];
    }
    den[j] = sum;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* vr = slot(a, a.v, h, s, lo + i);
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * n + i];
      float* o = out + j * a.dh;
      for (int64_t d = 0; d < a.dh; ++d) o[d] += p * vr[d];
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float inv = den[j] > 0.f ? 1.f / den[j] : 0.f;
    float* o = out + j * a.dh;
    for (int64_t d = 0; d < a.dh; ++d) o[d] *= inv;
  }
}

// Below this many multiply-adds (over every item) the call stays on the calling thread.
constexpr int64_t kThreadedWork = 1 << 18;

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> cu,
                          ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                          ffi::ResultBuffer<ffi::F32> out, float sm_scale, int64_t window,
                          float soft_cap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = pages.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("jaxinfer_paged_attention: bad ranks or K/V shapes");
  Attn a{};
  a.t = qd[0];
  a.hq = qd[1];
  a.dh = qd[2];
  a.hkv = kd[0];
  a.n_pages = kd[1];
  a.ps = kd[2];
  a.p_width = pd[1];
  const int64_t s = pd[0];
  if (kd[3] != a.dh || a.hkv == 0 || a.hq % a.hkv || kv_lens.element_count() != s ||
      cu.element_count() != s + 1 || num_seqs.element_count() != 1 ||
      (sinks.element_count() != 0 && sinks.element_count() != a.hq))
    return ffi::Error::InvalidArgument("jaxinfer_paged_attention: shapes do not agree");
  a.q = q.typed_data();
  a.k = k.typed_data();
  a.v = v.typed_data();
  a.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  a.kv_lens = kv_lens.typed_data();
  a.pages = pages.typed_data();
  a.cu = cu.typed_data();
  a.out = out->typed_data();
  a.window = window;
  a.sm_scale = sm_scale;
  a.soft_cap = soft_cap;
  // each row's sequence (-1: none), and the work it stands for
  std::vector<int32_t> row_seq(a.t, -1);
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, s);
  int64_t work = 0;
  for (int64_t i = 0; i < live; ++i) {
    const int64_t b = std::max<int64_t>(0, a.cu[i]), e = std::min<int64_t>(a.t, a.cu[i + 1]);
    for (int64_t r = b; r < e; ++r) row_seq[r] = static_cast<int32_t>(i);
    work += std::max<int64_t>(0, e - b) * std::min<int64_t>(a.kv_lens[i], a.window > 0 ? a.window : a.kv_lens[i]);
  }
  a.row_seq = row_seq.data();
  work *= 2 * a.hq * a.dh;
  const int64_t items = a.t * a.hkv;
  const int64_t threads = work < kThreadedWork ? 1 : std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || items == 1) {
    for (int64_t i = 0; i < items; ++i) item(a, i / a.hkv, i % a.hkv);
    return ffi::Error::Success();
  }
  const int64_t chunk = std::max<int64_t>(1, items / (threads * 4));
  jaxinfer_cpu::helpers().parallel((items + chunk - 1) / chunk, threads, [&](int64_t c) {
    for (int64_t i = c * chunk; i < std::min(items, (c + 1) * chunk); ++i)
      item(a, i / a.hkv, i % a.hkv);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, Dh]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pages [Hkv, N, ps, Dh]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, Dh]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("soft_cap"));
