// Fused dequant matmul for GGUF block weights on CPU, an XLA FFI custom call
// (cpu_dequant_matmul.py beside it builds and registers it, and packs the weights).
//
// y[t, n] = sum_k x[t, k] * w[n, k], where w[n, k] = q[n, k] * scale[n, k / B] (+ offset[n, k / B])
// is formed in registers from the int8 value: exactly gguf's float32 weight (compiled with
// -ffp-contract=off, so the multiply and the add round separately as numpy's do), never stored.
//
// Layout: the weights come in panels of P output features (P = 64, 32 or 16), k-major inside a
// panel: q [N / P, K, P] int8, scale and offset [N / P, K / B, P] float32. One k of a panel is
// then P consecutive int8 values, 16 of them one vector of 16 output features, so the product is
// an outer-product GEMM: per k, a broadcast x[t, k] times the formed weight vectors, into
// accumulators of R rows x NV vectors held in registers. Each formed weight feeds R FMAs, and the
// rows' x values are broadcast loads; the dot-product form over [N, K] rows (16 k per vector,
// a lane sum per output) ran at about 60 % of this rate from a few rows on
// (docs/perf/gguf-cpu.md).
//
// Numbers: each y[t, n] is one float32 FMA chain over k = 0, 1, ..., K - 1 in order, starting from
// zero. That order depends on nothing but k, so a row's result is bit-identical whatever other
// rows share the call (batch invariance: a token gets the same logits in a decode step, a
// prefill chunk or a recompute) and whichever thread computes it.
//
// Threads: (group of consecutive panels, block of rows) items go to XLA's intra-op thread pool
// plus the calling thread, which waits only for items already claimed (so a busy or one-thread
// pool cannot deadlock it).

#include <algorithm>
#include <cstdint>

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
using jaxllm::kLanes;
using jaxllm::load;
using jaxllm::splat;

// Rows per register tile: with 4 weight vectors (64 features) 24 accumulators; the scales stay
// in L1 when registers run out (tiles of 8 rows x 2 vectors ran ~12 % slower at 16 rows).
constexpr int64_t kRowTile = 6;
constexpr int64_t kRowBlock = 64;  // rows per work item: x's rows stay in L2 across the panel

struct Problem {
  const float* x;       // [T, K]
  const int8_t* q;      // [N / P, K, P]
  const float* scale;   // [N / P, K / B, P]
  const float* offset;  // [N / P, K / B, P] or nullptr
  float* y;             // [T, N]
  int64_t T, K, N, P;
};

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

// Rows [t0, t0 + R) against output features [n0, n0 + 16 NV) of one panel (n0 a multiple of
// 16 inside it). R and NV are template constants so the accumulators stay in registers; every
// (row, feature) pair gets the same arithmetic for every R and NV.
//
// Per block of B k, the integers go into a partial sum (x * q, exact integers as floats) and the
// block's scale multiplies that sum once, instead of every weight: one multiply per 16 weights
// fewer, and this loop is bound by vector operations, not by the bytes it reads. The weight a
// sum applies is still exactly gguf's (a unit vector x gives round(q * scale) + offset, as gguf
// rounds); only where the float32 roundings of the sum fall moves, as in any float32 GEMM's
// summation order.
template <int R, int NV, int B, bool kOffset>
void tile(const Problem& p, int64_t panel, int64_t n0, int64_t t0) {
  f32x16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = f32x16{};
  const int64_t col = n0 - panel * p.P;  // first feature inside the panel
  const int8_t* qp = p.q + panel * p.K * p.P + col;
  const float* sp = p.scale + panel * (p.K / B) * p.P + col;
  const float* op = kOffset ? p.offset + panel * (p.K / B) * p.P + col : nullptr;
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + (t0 + r) * p.K;
  for (int64_t kb = 0; kb < p.K; kb += B) {
    f32x16 part[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) part[r][v] = f32x16{};
    for (int64_t k = kb; k < kb + B; ++k) {
      f32x16 w[NV];
      for (int v = 0; v < NV; ++v) w[v] = load_q16(qp + k * p.P + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const f32x16 xb = splat(xr[r][k]);
        for (int v = 0; v < NV; ++v) part[r][v] = fma16(xb, w[v], part[r][v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const f32x16 sc = load(sp + (kb / B) * p.P + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v] = fma16(part[r][v], sc, acc[r][v]);
    }
    if (kOffset) {
      // The offset multiplies the block's sum of x: sum_k x[k] (q[k] scale + offset).
      f32x16 of[NV];
      for (int v = 0; v < NV; ++v) of[v] = load(op + (kb / B) * p.P + v * kLanes);
      for (int r = 0; r < R; ++r) {
        float sum = 0.0f;
        for (int64_t k = kb; k < kb + B; ++k) sum += xr[r][k];
        const f32x16 sb = splat(sum);
        for (int v = 0; v < NV; ++v) acc[r][v] = fma16(sb, of[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      jaxllm::store(p.y + (t0 + r) * p.N + n0 + v * kLanes, acc[r][v]);
}

// Rows [t0, t0 + R) against a whole panel, 4 vectors (64 features) at a time, fewer where the
// panel is narrower.
template <int R, int B, bool kOffset>
void rows_by_panel(const Problem& p, int64_t panel, int64_t t0) {
  const int64_t vectors = p.P / kLanes;
  for (int64_t v = 0; v < vectors;) {
    const int64_t n0 = panel * p.P + v * kLanes;
    if (vectors - v >= 4) {
      tile<R, 4, B, kOffset>(p, panel, n0, t0);
      v += 4;
    } else if (vectors - v >= 2) {
      tile<R, 2, B, kOffset>(p, panel, n0, t0);
      v += 2;
    } else {
      tile<R, 1, B, kOffset>(p, panel, n0, t0);
      v += 1;
    }
  }
}

// Rows [t0, t1) of x against one panel, in register tiles of up to kRowTile rows, each forming
// the weights it needs in registers. (Forming a panel's weights once into an L1/L2 buffer for
// all row tiles instead, as a float32 GEMM packs its operand, ran slower at 16 to 512 rows:
// docs/perf/gguf-cpu.md.)
template <int B, bool kOffset>
void run_item(const Problem& p, int64_t panel, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + kRowTile <= t1; t += kRowTile) rows_by_panel<kRowTile, B, kOffset>(p, panel, t);
  switch (t1 - t) {
    case 5: rows_by_panel<5, B, kOffset>(p, panel, t); break;
    case 4: rows_by_panel<4, B, kOffset>(p, panel, t); break;
    case 3: rows_by_panel<3, B, kOffset>(p, panel, t); break;
    case 2: rows_by_panel<2, B, kOffset>(p, panel, t); break;
    case 1: rows_by_panel<1, B, kOffset>(p, panel, t); break;
    default: break;
  }
}

// The block size (a template constant: a runtime one cost an integer division per 16 weights)
// and whether the format has offsets.
void run_item(const Problem& p, int64_t B, int64_t panel, int64_t t0, int64_t t1) {
  if (B == 32) {
    if (p.offset) run_item<32, true>(p, panel, t0, t1); else run_item<32, false>(p, panel, t0, t1);
  } else {
    if (p.offset) run_item<16, true>(p, panel, t0, t1); else run_item<16, false>(p, panel, t0, t1);
  }
}

ffi::Error DequantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                         bool has_offset) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3 || xd[1] != qd[1] || sd[0] != qd[0] ||
      sd[2] != qd[2] || (qd[2] != 16 && qd[2] != 32 && qd[2] != 64) || sd[1] == 0 ||
      qd[1] % sd[1] != 0 || (qd[1] / sd[1] != 16 && qd[1] / sd[1] != 32)) {
    return ffi::Error::InvalidArgument(
        "dequant_matmul: expected x [T, K], q [N / P, K, P] with P 16, 32 or 64, scale "
        "[N / P, K / B, P] with B 16 or 32");
  }
  auto od = offset.dimensions(), yd = y->dimensions();
  if (has_offset && (od.size() != 3 || od[0] != sd[0] || od[1] != sd[1] || od[2] != sd[2])) {
    return ffi::Error::InvalidArgument("dequant_matmul: offset must have scale's shape");
  }
  const int64_t n = qd[0] * qd[2];
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != n) {
    return ffi::Error::InvalidArgument("dequant_matmul: result must be [T, N]");
  }
  const Problem p{x.typed_data(), q.typed_data(), scale.typed_data(),
                  has_offset ? offset.typed_data() : nullptr, y->typed_data(),
                  xd[0], qd[1], n, qd[2]};
  const int64_t block = qd[1] / sd[1];
  const int64_t row_blocks = (p.T + kRowBlock - 1) / kRowBlock;
  // Consecutive panels per item, about 256 KiB of consecutive weights where the weight is large
  // enough (the prefetchers ramp up over a long run; few rows read at memory speed), and about
  // a multiple of the threads in number (near-equal shares when they run equally fast).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t panel_bytes = p.K * p.P;
  int64_t groups = std::max<int64_t>(1, qd[0] * panel_bytes / (256 * 1024));
  groups = (groups + threads - 1) / threads * threads;
  const int64_t per_item = std::max<int64_t>(1, (qd[0] + groups - 1) / groups);
  const int64_t items = (qd[0] + per_item - 1) / per_item;
  // A group's row blocks together (its weights stay in cache between them).
  jaxllm::parallel_for(pool, items * row_blocks, [&p, block, row_blocks, per_item](int64_t i) {
    const int64_t group = i / row_blocks, rb = i % row_blocks;
    const int64_t t0 = rb * kRowBlock, t1 = std::min(p.T, (rb + 1) * kRowBlock);
    const int64_t last = std::min(p.N / p.P, (group + 1) * per_item);
    for (int64_t panel = group * per_item; panel < last; ++panel)
      run_item(p, block, panel, t0, t1);
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
