// Fused dequant matmul for GGUF block weights on CPU, an XLA FFI custom call
// (cpu_dequant_matmul.py beside it builds and registers it).
//
// y[t, n] = sum_k x[t, k] * w[n, k], where w[n, k] = q[n, k] * scale[n, k / B] (+ offset[n, k / B])
// is formed in registers from the int8 value: exactly gguf's float32 weight (compiled with
// -ffp-contract=off, so the multiply and the add round separately as numpy's do), never stored.
// Each weight row is read from memory once per call, whatever the number of rows t: XLA's fused
// GEMV reads the weight once per row and falls back to materialising the float32 weight for
// any multi-row dot, which is why the quantized path needed this kernel.
//
// Numbers: per (t, n) the sum runs in two 16-lane accumulators (k mod 32 below / above 16; lane
// l takes k = l mod 16 of its half, in order, one fma each), added lane-wise, then a fixed
// pairwise tree over the lanes. That order depends on nothing but k, so a row's result is
// bit-identical whatever other rows share the call (batch invariance) and
// whichever thread computes it.
//
// Threads: output rows go in chunks to XLA's intra-op thread pool plus the calling thread, which
// waits only for chunks already claimed (so a busy or one-thread pool cannot deadlock it).

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int kRowTile = 8;  // rows of x whose accumulators live in registers at once
constexpr int kPairTile = 6;  // the same with two weight rows

struct Problem {
  const float* x;       // [T, K]
  const int8_t* q;      // [N, K]
  const float* scale;   // [N, K / B]
  const float* offset;  // [N, K / B] or nullptr
  float* y;             // [T, N]
  int64_t T, K, N, B;
};

// GCC/Clang vector types: 16 lanes, compiled to whatever SIMD -march=native has (one zmm on
// AVX-512, two ymm on AVX2), with the same per-lane arithmetic on every target.
typedef float f32x16 __attribute__((vector_size(64)));

inline float lane_sum(f32x16 a) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

// acc + a * b rounded once, where the CPU has FMA (the file is compiled with contraction off,
// which keeps the dequantization's multiply and add rounding separately).
inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 acc) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                  reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(acc)));
#elif defined(__FMA__)
  typedef float f32x8 __attribute__((vector_size(32)));
  f32x8 lo[3], hi[3];
  __builtin_memcpy(lo, &a, 32); __builtin_memcpy(hi, reinterpret_cast<char*>(&a) + 32, 32);
  __builtin_memcpy(lo + 1, &b, 32); __builtin_memcpy(hi + 1, reinterpret_cast<char*>(&b) + 32, 32);
  __builtin_memcpy(lo + 2, &acc, 32);
  __builtin_memcpy(hi + 2, reinterpret_cast<char*>(&acc) + 32, 32);
  f32x8 rl = reinterpret_cast<f32x8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(lo[0]),
      reinterpret_cast<__m256>(lo[1]), reinterpret_cast<__m256>(lo[2])));
  f32x8 rh = reinterpret_cast<f32x8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(hi[0]),
      reinterpret_cast<__m256>(hi[1]), reinterpret_cast<__m256>(hi[2])));
  f32x16 r;
  __builtin_memcpy(&r, &rl, 32); __builtin_memcpy(reinterpret_cast<char*>(&r) + 32, &rh, 32);
  return r;
#else
  return a * b + acc;
#endif
}

// 16 int8 values as floats (exact). GCC's __builtin_convertvector scalarises this conversion,
// hence the intrinsics.
inline f32x16 load_q16(const int8_t* p) {
#if defined(__AVX512F__)
  __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(v));
#elif defined(__AVX2__)
  __m256 lo = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  __m256 hi = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  f32x16 r;
  __builtin_memcpy(&r, &lo, 32);
  __builtin_memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  f32x16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = static_cast<float>(p[l]);
  return r;
#endif
}

// (Not `f32x16{} + v`: the compiler must then add +0.0f, which is not a no-op for -0.0f.)
inline f32x16 splat(float v) {
  return f32x16{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
}

inline f32x16 load(const float* p) {
  f32x16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// 16 weights from k = j on, formed exactly as gguf's float32 values.
template <int B, bool kOffset>
inline f32x16 weights(const int8_t* qn, const float* sn, const float* on, int64_t j) {
  f32x16 w = load_q16(qn + j) * splat(sn[j / B]);
  if (kOffset) w = w + splat(on[j / B]);
  return w;
}

// Rows [t0, t0 + R) of x against the NR weight rows ns[]. R and NR are template constants so
// the accumulators stay in registers; the arithmetic of each (row, weight row) pair is the same
// for every R and NR. Two accumulators per pair (k mod 32 below or above 16) hide the FMA
// latency of a single chain.
template <int R, int NR, int B, bool kOffset>
inline void tile(const Problem& p, const int64_t* ns, int64_t t0) {
  f32x16 acc0[NR][R], acc1[NR][R];
  const int8_t* qn[NR];
  const float* sn[NR];
  const float* on[NR];
  const int64_t nb = p.K / B;
  for (int i = 0; i < NR; ++i) {
    for (int r = 0; r < R; ++r) acc0[i][r] = acc1[i][r] = f32x16{};
    qn[i] = p.q + ns[i] * p.K;
    sn[i] = p.scale + ns[i] * nb;
    on[i] = kOffset ? p.offset + ns[i] * nb : nullptr;
  }
  for (int64_t j = 0; j < p.K; j += 2 * kLanes) {
    for (int i = 0; i < NR; ++i) {
      const f32x16 w0 = weights<B, kOffset>(qn[i], sn[i], on[i], j);
      const f32x16 w1 = weights<B, kOffset>(qn[i], sn[i], on[i], j + kLanes);
      for (int r = 0; r < R; ++r) {
        const float* xr = p.x + (t0 + r) * p.K + j;
        acc0[i][r] = fma16(load(xr), w0, acc0[i][r]);
        acc1[i][r] = fma16(load(xr + kLanes), w1, acc1[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) p.y[(t0 + r) * p.N + ns[i]] = lane_sum(acc0[i][r] + acc1[i][r]);
}

// Every row of x against the NR weight rows ns[], in tiles of up to kRowTile rows (kPairTile
// with two weight rows: 24 accumulators and 2 weight vectors, within AVX-512's 32 zmm
// registers). Each tile forms the weights again, so the fewer tiles the better; two weight
// rows are preferred for their two prefetch streams (run_rows).
template <int NR, int B, bool kOffset>
void weight_rows(const Problem& p, const int64_t* ns) {
  int64_t t = 0;
  constexpr int kTile = NR == 1 ? kRowTile : kPairTile;
  for (; t + kTile <= p.T; t += kTile) tile<kTile, NR, B, kOffset>(p, ns, t);
  switch (p.T - t) {
    case 7: tile<7, NR, B, kOffset>(p, ns, t); break;
    case 6: tile<6, NR, B, kOffset>(p, ns, t); break;
    case 5: tile<5, NR, B, kOffset>(p, ns, t); break;
    case 4: tile<4, NR, B, kOffset>(p, ns, t); break;
    case 3: tile<3, NR, B, kOffset>(p, ns, t); break;
    case 2: tile<2, NR, B, kOffset>(p, ns, t); break;
    case 1: tile<1, NR, B, kOffset>(p, ns, t); break;
    default: break;
  }
}

// Weight rows [n0, n1), two at once from the range's two halves: two sequential streams, which
// the CPU's prefetchers serve faster than one; two *adjacent* rows read slower still, the
// interleaved addresses defeating the prefetcher (docs/perf/gguf-cpu.md).
template <int B, bool kOffset>
void run_rows(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t half = (n1 - n0 + 1) / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ns[2] = {n0 + i, n0 + half + i};
    if (ns[1] < n1) weight_rows<2, B, kOffset>(p, ns); else weight_rows<1, B, kOffset>(p, ns);
  }
}

// The block size (a template constant: a runtime one cost an integer division per 16 weights)
// and whether the format has offsets.
void run_rows(const Problem& p, int64_t n0, int64_t n1) {
  if (p.B == 32) {
    if (p.offset) run_rows<32, true>(p, n0, n1); else run_rows<32, false>(p, n0, n1);
  } else {
    if (p.offset) run_rows<16, true>(p, n0, n1); else run_rows<16, false>(p, n0, n1);
  }
}

ffi::Error DequantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                         bool has_offset) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || xd[1] != qd[1] || sd[0] != qd[0] ||
      sd[1] == 0 || qd[1] % sd[1] != 0 || (qd[1] / sd[1] != 16 && qd[1] / sd[1] != 32) ||
      qd[1] % (2 * kLanes) != 0) {
    return ffi::Error::InvalidArgument("dequant_matmul: expected x [T, K], q [N, K], scale "
                                       "[N, K / B] with B 16 or 32 and K a multiple of 32");
  }
  auto od = offset.dimensions(), yd = y->dimensions();
  if (has_offset && (od.size() != 2 || od[0] != sd[0] || od[1] != sd[1])) {
    return ffi::Error::InvalidArgument("dequant_matmul: offset must have scale's shape");
  }
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != qd[0]) {
    return ffi::Error::InvalidArgument("dequant_matmul: result must be [T, N]");
  }
  const Problem p{x.typed_data(), q.typed_data(), scale.typed_data(),
                  has_offset ? offset.typed_data() : nullptr, y->typed_data(),
                  xd[0], qd[1], qd[0], qd[1] / sd[1]};
  // Chunks of >= ~256 KiB of int8 weight (long sequential streams for the prefetchers), about
  // a multiple of the threads in number (near-equal shares when they run equally fast).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunks = std::max<int64_t>(1, qd[0] * qd[1] / (256 * 1024));
  chunks = (chunks + threads - 1) / threads * threads;
  const int64_t chunk_rows = std::max<int64_t>(1, (qd[0] + chunks - 1) / chunks);
  const int64_t count = (qd[0] + chunk_rows - 1) / chunk_rows;
  jaxllm::parallel_for(pool, count, [&p, chunk_rows](int64_t c) {
    run_rows(p, c * chunk_rows, std::min(p.N, (c + 1) * chunk_rows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDequantMatmul, DequantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_offset"));
