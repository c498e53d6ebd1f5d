// Paged attention on CPU, an XLA FFI custom call (cpu_attention.py beside it builds and
// registers it).
//
// Each query token attends to its own sequence's keys 0..its position (with a sliding window W,
// position - W + 1..its position; blocks wholly before the window are not read), block by block
// through the block table straight from the all-layer cache; online softmax in float32 (the
// running max, the sum of exponentials, the weighted values), optionally over soft-capped
// logits (cap * tanh(logit / cap), Gemma 2). The query heads of one KV head
// and up to kQueryTile consecutive queries of a sequence go together, so each key and value row
// is read once for all of them. Work is split into (query tile, KV head) items over XLA's
// intra-op pool and the calling thread.
//
// A token's arithmetic is the same whatever step it is in (decode, beside others, in a prefill
// chunk, recomputed after preemption): the engine's results must not depend on the batch.
//
// Why a kernel: XLA's version of this (pallas_kernels/reference_attention.py) is a while loop
// per layer whose iterations cost microseconds of dispatch each; at batch 1 and a few hundred
// tokens of context it took longer than the arithmetic by several times (docs/perf/cpu-step.md).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxllm::f32x16;
using jaxllm::fma16;
using jaxllm::IReg;
using jaxllm::kLanes;
using jaxllm::load;
using jaxllm::Reg;
using jaxllm::splat;
using jaxllm::splat_reg;
using jaxllm::store;

// A pairwise tree: lane l + lane l + 8, then l + l + 4, l + l + 2, l + l + 1: 4 dependent adds,
// not 16. Where a register holds 8 or 4 lanes, the first steps add whole registers (the same
// pairs), the last ones halves of a register.
inline float lane_sum(f32x16 a) {
  for (int half = jaxllm::kParts / 2; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) a.part[i] = a.part[i] + a.part[i + half];
#if defined(__aarch64__)
  const float32x4_t s4 = reinterpret_cast<float32x4_t>(a.part[0]);
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
#else
#if defined(__AVX512F__)
  const __m512d v = reinterpret_cast<__m512d>(a.part[0]);
  const __m256 s8 = _mm256_add_ps(_mm256_castpd_ps(_mm512_castpd512_pd256(v)),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(v, 1)));
#elif defined(__AVX__)
  const __m256 s8 = reinterpret_cast<__m256>(a.part[0]);
#endif
#if defined(__AVX__)
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
#else
  const __m128 s4 = reinterpret_cast<__m128>(a.part[0]);
#endif
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#endif
}

inline float lane_max(f32x16 a) {
  float m = a[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, a[l]);
  return m;
}

// exp(x) per lane for x <= 0 (logits minus their running max): x = n ln2 + r with n an integer
// and |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, times 2^n built in the exponent bits;
// within a few ulp of expf. Below -87 (where expf < 2^-125) the result is 0. One register at a
// time (the same operations on every target).
inline Reg exp_reg(Reg x) {
  const IReg underflow = x < splat_reg(-87.0f);
  x = underflow ? splat_reg(-87.0f) : x;
  // n = round(x / ln2) for x <= 0: truncation of (y - 0.5) rounds toward +inf, i.e. to nearest.
  const IReg n = __builtin_convertvector(x * splat_reg(1.44269504088896341f) - splat_reg(0.5f),
                                         IReg);
  const Reg nf = __builtin_convertvector(n, Reg);
  const Reg r = (x - nf * splat_reg(0.693359375f)) + nf * splat_reg(2.12194440e-4f);
  Reg y = splat_reg(1.9875691500e-4f);
  y = y * r + splat_reg(1.3981999507e-3f);
  y = y * r + splat_reg(8.3334519073e-3f);
  y = y * r + splat_reg(4.1665795894e-2f);
  y = y * r + splat_reg(1.6666665459e-1f);
  y = y * r + splat_reg(5.0000001201e-1f);
  y = y * (r * r) + r + splat_reg(1.0f);
  const Reg two_n = reinterpret_cast<Reg>((n + 127) << 23);
  return underflow ? splat_reg(0.0f) : y * two_n;
}

inline f32x16 exp16(f32x16 x) {
  f32x16 r;
  for (int i = 0; i < jaxllm::kParts; ++i) r.part[i] = exp_reg(x.part[i]);
  return r;
}

// tanh(x) per lane, Cephes' tanhf: for |x| < 0.625 its odd polynomial x + x z P(z), z = x^2
// (no cancellation near 0); above, (1 - t) / (1 + t) with t = exp(-2|x|) from exp_reg (which
// takes x <= 0; t <= 0.29 there, so 1 - t loses nothing), the sign of x put back. Both are
// computed and one is selected per lane; within a few ulp of tanhf, and +-1 exactly from
// |x| >= 43.5 on (t underflows to 0).
inline Reg tanh_reg(Reg x) {
  const Reg zero = splat_reg(0.0f);
  const IReg negative = x < zero;
  const Reg ax = negative ? -x : x;
  const Reg z = x * x;
  Reg poly = splat_reg(-5.70498872745e-3f);
  poly = poly * z + splat_reg(2.06390887954e-2f);
  poly = poly * z + splat_reg(-5.37397155531e-2f);
  poly = poly * z + splat_reg(1.33314422036e-1f);
  poly = poly * z + splat_reg(-3.33332819422e-1f);
  const Reg small = poly * z * x + x;
  const Reg t = exp_reg(ax * splat_reg(-2.0f));
  const Reg large = (splat_reg(1.0f) - t) / (splat_reg(1.0f) + t);
  return ax < splat_reg(0.625f) ? small : (negative ? -large : large);
}

// Gemma 2's attention soft cap on a chunk's logits: cap * tanh(logit / cap), as Hugging Face
// computes it; masked keys (-inf) stay -inf.
inline f32x16 soft_cap16(f32x16 x, float cap) {
  f32x16 r;
  const Reg c = splat_reg(cap), masked = splat_reg(-INFINITY);
  for (int i = 0; i < jaxllm::kParts; ++i) {
    const Reg capped = c * tanh_reg(x.part[i] / c);
    r.part[i] = x.part[i] == masked ? masked : capped;
  }
  return r;
}

struct Problem {
  const float* q;          // [T, H, D]
  const float* kv;         // [L, 2, KVH, NB, BS, D]
  const int32_t* tables;   // [S, MB]
  const int32_t* seq_lens; // [S]
  const int32_t* qsl;      // [S + 1]
  float* out;              // [T, H, D]
  int64_t T, H, D, KVH, NB, BS, S, MB, layer;
  float scale;
  int64_t window;  // keys a query sees, its own included; 0: all of them
  float soft_cap;  // logits -> soft_cap * tanh(logits / soft_cap); 0: none
};

constexpr int64_t kMaxHeadDim = 256;
// Consecutive queries of one sequence that share each key and value row read from the cache.
constexpr int64_t kQueryTile = 8;
// Register tiles per target (cpu_simd.h): a key row's vectors held in registers while every
// (query, head) row of the tile takes its dot product with it (the rest are read from L1 per
// row): half the registers, the other half for the dot product, its operand and its lane sum;
// and the value vectors a row accumulates per pass over a chunk of keys, leaving room for the
// key's weight and one operand.
constexpr int kKeysInRegisters = jaxllm::kVectorBudget / 2;
constexpr int kValuesInRegisters = jaxllm::kVectorBudget - 2;

// Per-thread scratch for one item, kept between items and calls (no allocation per item).
struct Scratch {
  std::vector<f32x16> qs, acc;
  std::vector<float> m, l, alpha, logits, probs;
  void resize(size_t rows, size_t c) {
    if (qs.size() < rows * c) {
      qs.resize(rows * c);
      acc.resize(rows * c);
    }
    if (m.size() < rows) {
      m.resize(rows);
      l.resize(rows);
      alpha.resize(rows);
      logits.resize(rows * kLanes);
      probs.resize(rows * kLanes);
    }
  }
};

// A row's accumulator vectors [C0, C0 + N) (then the rest, N at a time): scaled by alpha, then
// the values of keys 0 .. n - 1 (rows D floats apart) weighted by their probabilities, in key
// order. Every vector gets the same operations whatever N is.
template <int C, int C0, int N>
inline void weigh_values(f32x16* acc, const float* probs, const float* values, int64_t n,
                         float alpha) {
  constexpr int64_t D = C * kLanes;
  f32x16 a[N];
#pragma GCC unroll 16
  for (int c = 0; c < N; ++c) a[c] = acc[C0 + c] * splat(alpha);
  for (int64_t j = 0; j < n; ++j) {
    const f32x16 pj = splat(probs[j]);
    const float* vj = values + j * D + C0 * kLanes;
#pragma GCC unroll 16
    for (int c = 0; c < N; ++c) a[c] = fma16(pj, load(vj + c * kLanes), a[c]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < N; ++c) acc[C0 + c] = a[c];
  if constexpr (C0 + N < C)
    weigh_values<C, C0 + N, std::min(N, C - C0 - N)>(acc, probs, values, n, alpha);
}

// The logits of keys 0 .. 15 of a chunk (rows D floats apart from `keys`, the first `rows` of
// them there) for the tile's (query, head) rows of queries i0 .. i1 - 1 (G heads per query,
// query vectors `qs`, C per row): query i sees keys from below + i + 1 to
// min(cap, seen + i) - 1, the rest are -inf. Each key row is loaded once for all of them, the
// first kKeysInRegisters vectors into registers. Not inlined: the register allocator sees this
// loop nest alone.
template <int C>
[[gnu::noinline]] void chunk_logits(const f32x16* qs, const float* keys, int64_t rows,
                                    int64_t cap, int64_t seen, int64_t below, int64_t i0,
                                    int64_t i1, int64_t G, float* logits) {
  constexpr int64_t D = C * kLanes;
  constexpr int kKeys = std::min(C, kKeysInRegisters);
  for (int64_t j = 0; j < kLanes; ++j) {
    const bool row = j < rows;
    const float* kj = keys + j * D;
    f32x16 k[kKeys];
    if (row) {
#pragma GCC unroll 16
      for (int c = 0; c < kKeys; ++c) k[c] = load(kj + c * kLanes);
    }
    for (int64_t i = i0; i < i1; ++i) {
      const bool visible = row && j < std::min(cap, seen + i) && j > below + i;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        if (!visible) {
          logits[r * kLanes + j] = -INFINITY;
          continue;
        }
        f32x16 dot = qs[r * C] * k[0];
#pragma GCC unroll 16
        for (int c = 1; c < kKeys; ++c) dot = fma16(qs[r * C + c], k[c], dot);
#pragma GCC unroll 16
        for (int c = kKeys; c < C; ++c) dot = fma16(qs[r * C + c], load(kj + c * kLanes), dot);
        logits[r * kLanes + j] = lane_sum(dot);
      }
    }
  }
}

// Queries t0 .. t0 + nq - 1 of sequence s (positions pos0 .. pos0 + nq - 1) against their keys
// for the query heads of KV head h; C = head_dim / 16 vectors per row (a template constant, so
// a row's accumulators stay in registers). Keys come in chunks of up to 16: each key row is
// loaded once for every (query, head) row of the tile; per row the chunk's logits go through
// one online-softmax step and the values are weighted into its accumulator. A row's arithmetic
// (the chunks it visits, their order, every operation) does not depend on the other queries of
// its tile, so a token gets bit-identical results however the step groups it.
//
// Not inlined: its loops get the registers to themselves, none holding the caller's values.
template <int C>
[[gnu::noinline]] void attend(const Problem& p, int64_t s, int64_t t0, int64_t nq, int64_t pos0,
                              int64_t h) {
  constexpr int64_t D = C * kLanes;
  const int64_t G = p.H / p.KVH, R = nq * G;
  thread_local Scratch w;
  w.resize(static_cast<size_t>(R), C);
  f32x16* qs = w.qs.data();
  f32x16* acc = w.acc.data();
  float *m = w.m.data(), *l = w.l.data(), *alphas = w.alpha.data();
  float *logits = w.logits.data(), *probs = w.probs.data();
  // Value vectors per pass: C in near-equal chunks of at most kValuesInRegisters.
  constexpr int kValueChunk =
      (C + (C + kValuesInRegisters - 1) / kValuesInRegisters - 1) /
      ((C + kValuesInRegisters - 1) / kValuesInRegisters);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      m[r] = -INFINITY;
      l[r] = 0.0f;
      for (int c = 0; c < C; ++c) {
        qs[r * C + c] = load(p.q + ((t0 + i) * p.H + h * G + g) * D + c * kLanes) *
                        splat(p.scale);
        acc[r * C + c] = f32x16{};
      }
    }
  const int64_t last = pos0 + nq - 1;  // the tile's last query sees the most keys
  const int64_t head_stride = p.NB * p.BS * D;
  const float* k_head = p.kv + ((p.layer * 2 + 0) * p.KVH + h) * head_stride;
  const float* v_head = p.kv + ((p.layer * 2 + 1) * p.KVH + h) * head_stride;
  // Without a window every key is at or after every query's window start.
  const int64_t window = p.window > 0 ? p.window : pos0 + nq;
  // From the block where the tile's first query's window starts.
  const int64_t first_key = std::max<int64_t>(0, pos0 - window + 1);
  for (int64_t start = first_key - first_key % p.BS; start <= last; start += p.BS) {
    const int64_t blk = std::clamp<int64_t>(p.tables[s * p.MB + start / p.BS], 0, p.NB - 1);
    const float* kb = k_head + blk * p.BS * D;
    const float* vb = v_head + blk * p.BS * D;
    if (start + p.BS <= last) {
      // The next block is elsewhere in the cache: ask for its rows now, so they arrive while
      // this block computes (the hardware prefetcher starts over at every block).
      const int64_t next =
          std::clamp<int64_t>(p.tables[s * p.MB + start / p.BS + 1], 0, p.NB - 1);
      const char* kn = reinterpret_cast<const char*>(k_head + next * p.BS * D);
      const char* vn = reinterpret_cast<const char*>(v_head + next * p.BS * D);
      for (int64_t off = 0; off < p.BS * D * 4; off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }
    }
    const int64_t n_last = std::min<int64_t>(p.BS, last + 1 - start);
    // Queries before `first` see no key of this block.
    const int64_t first = std::max<int64_t>(0, start - pos0);
    for (int64_t j0 = 0; j0 < n_last; j0 += kLanes) {
      const int64_t i0 = std::max<int64_t>(first, start + j0 - pos0);  // first query seeing j0
      // Queries from i1 on have their window start past this chunk's last key: they skip it
      // (a row must never take a step with every key -inf: its max would stay -inf).
      const int64_t n_chunk = std::min<int64_t>(kLanes, n_last - j0);
      const int64_t i1 = std::min<int64_t>(nq, start + j0 + n_chunk - pos0 + window - 1);
      // Query i sees chunk key j from j > below + i: key start + j0 + j > pos0 + i - window.
      const int64_t below = pos0 - window - start - j0;
      // Keys of this chunk visible to query i: nj(i) = min(16, position + 1 - key j0), the
      // rest are -inf (exp gives exactly 0, and nothing is weighted for them).
      auto nj = [&](int64_t i) {
        return std::min<int64_t>({kLanes, p.BS - j0, pos0 + i + 1 - start - j0});
      };
      chunk_logits<C>(qs, kb + j0 * D, n_chunk, std::min<int64_t>(kLanes, p.BS - j0),
                      pos0 + 1 - start - j0, below, i0, i1, G, logits);
      // The online-softmax step of every row first (its exp is a call, which would make the
      // value loop below keep its registers on the stack), then the values.
      for (int64_t r = i0 * G; r < i1 * G; ++r) {
        f32x16 lv = load(logits + r * kLanes);
        if (p.soft_cap > 0.0f) lv = soft_cap16(lv, p.soft_cap);
        const float m_new = std::max(m[r], lane_max(lv));
        const float alpha = std::exp(m[r] - m_new);  // 0 on the first keys (m = -inf)
        const f32x16 pv = exp16(lv - splat(m_new));  // masked keys: exp(-inf) = 0
        store(probs + r * kLanes, pv);
        l[r] = l[r] * alpha + lane_sum(pv);
        m[r] = m_new;
        alphas[r] = alpha;
      }
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n_i = nj(i);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          weigh_values<C, 0, kValueChunk>(acc + r * C, probs + r * kLanes, vb + j0 * D, n_i,
                                          alphas[r]);
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float* o = p.out + ((t0 + i) * p.H + h * G + g) * D;
      const f32x16 inv = splat(1.0f / l[r]);
      for (int c = 0; c < C; ++c) store(o + c * kLanes, acc[r * C + c] * inv);
    }
}

template <int C = 1>
void attend_dispatch(const Problem& p, int64_t s, int64_t t0, int64_t nq, int64_t pos0,
                     int64_t h) {
  if constexpr (C < kMaxHeadDim / kLanes) {
    if (p.D != C * kLanes) return attend_dispatch<C + 1>(p, s, t0, nq, pos0, h);
  }
  attend<C>(p, s, t0, nq, pos0, h);
}

// One unit of work: a query tile of one sequence, for one KV head.
struct Item {
  int64_t s, t0, nq, pos0, h;
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv,
                     ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> qsl, ffi::ResultBuffer<ffi::F32> out, int64_t layer,
                     float scale, int64_t window, float soft_cap) {
  auto qd = q.dimensions(), kd = kv.dimensions(), td = tables.dimensions();
  auto sd = seq_lens.dimensions(), ld = qsl.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 6 || td.size() != 2 || sd.size() != 1 || ld.size() != 1 ||
      kd[1] != 2 || kd[5] != qd[2] || qd[2] % kLanes != 0 || qd[2] > kMaxHeadDim ||
      kd[2] == 0 || qd[1] % kd[2] != 0 || td[0] != sd[0] || ld[0] != sd[0] + 1 || layer < 0 ||
      layer >= kd[0] || kd[3] == 0 || td[1] == 0 || window < 0 || !(soft_cap >= 0.0f) ||
      std::isinf(soft_cap)) {
    return ffi::Error::InvalidArgument(
        "cpu_paged_attention: expected q [T, H, D], kv [L, 2, KVH, NB, BS, D] with D a multiple "
        "of 16 up to 256 and H a multiple of KVH, block tables [S, MB], seq_lens [S], "
        "query_start_loc [S + 1], 0 <= layer < L, window >= 0, a finite soft_cap >= 0");
  }
  if (od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2]) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: result must be q's shape");
  }
  const Problem p{q.typed_data(), kv.typed_data(), tables.typed_data(), seq_lens.typed_data(),
                  qsl.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], kd[2], kd[3],
                  kd[4], sd[0], td[1], layer, scale, window, soft_cap};
  std::memset(p.out, 0, sizeof(float) * p.T * p.H * p.D);
  // A sequence's queries are its last b - a positions. Queries at negative positions (bad
  // metadata) or past the block table's width (keys would be read outside it) stay zero, and
  // rows past the last sequence's queries are padding.
  std::vector<Item> items;
  int64_t prev_end = 0;  // sequences' query rows never overlap, whatever query_start_loc says
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t a = std::clamp<int64_t>(p.qsl[s], prev_end, p.T);
    const int64_t b = std::clamp<int64_t>(p.qsl[s + 1], a, p.T);
    prev_end = b;
    const int64_t first_pos = p.seq_lens[s] - (b - a);
    const int64_t lo = std::max<int64_t>(a, a - first_pos);
    const int64_t hi = std::min<int64_t>(b, a + p.MB * p.BS - first_pos);
    for (int64_t t0 = lo; t0 < hi; t0 += kQueryTile)
      for (int64_t h = 0; h < p.KVH; ++h)
        items.push_back({s, t0, std::min<int64_t>(kQueryTile, hi - t0), first_pos + t0 - a, h});
  }
  // Longest first: tiles deep into a long prefill take the most time (a window caps a tile's
  // keys), and the pool hands out items in order.
  const int64_t cap = p.window > 0 ? p.window : INT64_MAX / 2;
  std::stable_sort(items.begin(), items.end(), [cap](const Item& x, const Item& y) {
    return std::min(x.pos0, cap) + x.nq > std::min(y.pos0, cap) + y.nq;
  });
  jaxllm::parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    attend_dispatch(p, it.s, it.t0, it.nq, it.pos0, it.h);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("soft_cap"));
