// Fused dequant matmul for GGUF block weights on CPU, an XLA FFI custom call
// (cpu_dequant_matmul.py beside it builds and registers it, and packs the weights).
//
// y[t, n] = sum_k x[t, k] * w[n, k], where w[n, k] = q[n, k] * scale[n, k / B] + offset[n, k / B]
// (no offset for most formats) is gguf's float32 weight: per block of B k the integer values q
// (exact as floats) go into a partial sum of x * q, which the block's scale then multiplies
// once (and the offset the block's sum of x). The weight each sum applies is exactly gguf's (a
// unit vector x gives round(q * scale), + offset rounded again, as numpy computes gguf's values;
// compiled with -ffp-contract=off so nothing else fuses); the roundings of the sum fall where a
// blocked float32 GEMM's would.
//
// Layout: the weights come in panels of P output features (P = 64, 32 or 16), k-major inside a
// panel: q [N / P, K, P] int8, scale and offset [N / P, K / B, P] float32. One k of a panel is
// then P consecutive int8 values, 16 of them one vector of 16 output features, so the product is
// an outer-product GEMM: per k, a broadcast x[t, k] times the weight vectors, into accumulators
// of R rows x NV vectors held in registers (sized per target: `fits`). Each converted vector
// feeds R FMAs, and the rows' x values are broadcast loads; the dot-product form over [N, K] rows (16 k per vector, a lane
// sum per output) ran at about 60 % of this rate from a few rows on (docs/perf/gguf-cpu.md).
//
// 5-bit panels (gguf_compact): values in -16..15 (Q5_0, Q4_0, Q4_K) in panels of 64 may come
// packed as q5 [N / 64, K, 40] uint8 instead, per k 32 bytes of low nibbles (byte j: feature j
// in its low half, j + 32 in its high half) and 8 bytes with feature f's sign in bit f, value =
// nibble - 16 * sign: 5 bits a weight instead of 8, for a few more vector operations per weight
// (docs/perf/gguf-cpu.md has what that costs).
//
// Numbers: each y[t, n] depends only on row t of x and on k's order, never on which other rows
// share the call or how they are tiled, so a row's result is bit-identical whatever else is in
// the batch (batch invariance: a token gets the same logits in a decode step, a prefill chunk
// or a recompute) and whichever thread computes it; 5-bit panels give the int8 panels' bits.
//
// Threads: (group of consecutive panels, block of rows) items go to XLA's intra-op thread pool
// plus the calling thread, which waits only for items already claimed (so a busy or one-thread
// pool cannot deadlock it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
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

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
constexpr bool kQ5Vbmi = true;  // 5-bit panels unpack in registers
#else
constexpr bool kQ5Vbmi = false;
#endif

// Registers the rows' x values take in the k loop: x86 broadcasts each row's from memory into
// one register in turn; NEON's FMA by element reads them from register lanes, one per row.
#if defined(__aarch64__)
constexpr int x_registers(int R) { return R; }
#else
constexpr int x_registers(int) { return 1; }
#endif

// Whether the k loop of a tile of R rows x NV vectors keeps everything in registers on this
// target (cpu_simd.h): its partial sums, one k's NV weight vectors and the x values, plus, to
// unpack a 5-bit panel in registers, the 4 lane indices, the packed bytes and 2 byte constants.
// The block's accumulators live in the result, read and written once per block.
constexpr bool fits(int R, int NV, bool q5 = false) {
  return (R * NV + NV) * jaxllm::kRegistersPerVector + x_registers(R) + (q5 ? 7 : 0) <=
         jaxllm::kVectorRegisters;
}
// Rows per register tile: the most that fit with one vector of features, up to 6 (tiles of 8
// rows x 2 vectors ran slower than 6 x 4 with AVX-512 at 16 rows: docs/perf/gguf-cpu.md). On
// AVX-512 that is 6 rows x 4 vectors (a 64-feature panel), on AVX2 6 rows x 1, on NEON 5 x 1.
constexpr int largest_row_tile(int nv, bool q5) {
  int r = 6;
  while (r > 1 && !fits(r, nv, q5)) --r;
  return r;
}
constexpr int kRowTile = largest_row_tile(1, false);
// Vectors of features per tile of R rows: 4, 2 or 1, the most that fit.
constexpr int vectors_for(int R) { return fits(R, 4) ? 4 : fits(R, 2) ? 2 : 1; }
constexpr int64_t kRowBlock = 64;  // rows per work item: x's rows stay in L2 across the panel
// Rows up to which a 5-bit panel is unpacked in registers (one tile, 4 vectors) rather than
// once per item into a buffer: past one tile, unpacking per tile repeats the unpacking. None
// without VBMI, whose unpacking (AVX2 or scalar code) costs more: once per item.
constexpr int64_t kQ5InRegisters = kQ5Vbmi ? largest_row_tile(4, true) : 0;

struct Problem {
  const float* x;       // [T, K]
  const int8_t* q;      // [N / P, K, P], or nullptr with q5
  const uint8_t* q5;    // [N / 64, K, 40] (P = 64), or nullptr
  const float* scale;   // [N / P, K / B, P]
  const float* offset;  // [N / P, K / B, P] or nullptr
  float* y;             // [T, N]
  int64_t T, K, N, P;
};

// 16 int8 values as floats (exact). GCC's __builtin_convertvector scalarises this conversion,
// hence the intrinsics.
inline f32x16 load_q16(const int8_t* p) {
  using jaxllm::Reg;
  f32x16 r;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  r.part[0] = reinterpret_cast<Reg>(_mm512_cvtepi32_ps(v));
#elif defined(__AVX2__)
  for (int i = 0; i < 2; ++i)
    r.part[i] = reinterpret_cast<Reg>(_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)))));
#elif defined(__aarch64__)
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t half[2] = {vmovl_s8(vget_low_s8(b)), vmovl_s8(vget_high_s8(b))};
  for (int i = 0; i < 4; ++i) {
    const int16x4_t q = i % 2 ? vget_high_s16(half[i / 2]) : vget_low_s16(half[i / 2]);
    r.part[i] = reinterpret_cast<Reg>(vcvtq_f32_s32(vmovl_s16(q)));
  }
#else
  for (int l = 0; l < kLanes; ++l)
    r.part[l / jaxllm::kRegisterLanes][l % jaxllm::kRegisterLanes] = static_cast<float>(p[l]);
#endif
  return r;
}

// How a tile reads a panel's values. kQ5 unpacks a 5-bit panel in registers for every tile (a
// few rows: the panel is read once), as value * 2^24; kQ5Bytes reads one unpacked once per
// item into a buffer of int8 (many rows: unpacking per tile of rows cost more than it saved),
// against rows of x times 2^24. Either way every product is x * value * 2^24, exactly, and
// `kQ5Unit` in the scale undoes the power of two exactly, so a row gets the same bits from both
// (and from int8 panels; short of x near float32's range limits, subnormal or past 2^104).
enum class Values { kInt8, kQ5, kQ5Bytes };
constexpr float kQ5Unit = 1.0f / 16777216.0f;

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
// One k of a 5-bit panel as 64 int8 values in feature order: both halves' nibbles, the signs
// added as -16.
inline __m512i q5_bytes(const uint8_t* p) {
  __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  b = _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xFFFF0000u, b, 4), _mm512_set1_epi8(15));
  uint64_t sign;
  std::memcpy(&sign, p + 32, 8);
  return _mm512_mask_add_epi8(b, sign, b, _mm512_set1_epi8(-16));
}

// vpermb indices: vector v, lane l <- byte 16 v + l, into bits 24..31 (a constant in memory, not
// built on the stack per tile).
struct Q5Lanes {
  alignas(64) int32_t top[4][kLanes];
};
constexpr Q5Lanes make_q5_lanes() {
  Q5Lanes t{};
  for (int v = 0; v < 4; ++v)
    for (int l = 0; l < kLanes; ++l) t.top[v][l] = (16 * v + l) << 24;
  return t;
}
constexpr Q5Lanes kQ5Lanes = make_q5_lanes();

// One k of a 5-bit panel as value * 2^24 in w[0..3]: each value byte goes to the top of its
// 32-bit lane, where the conversion reads it times 2^24 with no sign extension.
inline void load_q5(const uint8_t* p, f32x16 w[4]) {
  const __m512i b = q5_bytes(p);
  for (int v = 0; v < 4; ++v) {
    const __m512i lane = _mm512_maskz_permutexvar_epi8(
        0x8888888888888888ull, _mm512_load_si512(kQ5Lanes.top[v]), b);
    w[v].part[0] = reinterpret_cast<jaxllm::Reg>(_mm512_cvtepi32_ps(lane));
  }
}
#elif defined(__AVX2__)
// 32 sign bits as bytes: 0xFF where bit j is set, else 0.
inline __m256i q5_sign_bytes(uint32_t bits) {
  const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), byte_of_bit);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
#else
inline int q5_value(const uint8_t* p, int f) {
  return ((p[f % 32] >> (f / 32 * 4)) & 15) - 16 * ((p[32 + f / 8] >> (f % 8)) & 1);
}
#endif

// A 5-bit panel [K, 40] -> int8 values [K, 64].
inline void unpack_q5(const uint8_t* p, int64_t K, int8_t* out) {
  for (int64_t k = 0; k < K; ++k, p += 40, out += 64) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    _mm512_storeu_si512(out, q5_bytes(p));
#elif defined(__AVX2__)
    // Features 0..31 from the low nibbles, 32..63 from the high ones, -16 where signed.
    const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m15 = _mm256_set1_epi8(15), minus16 = _mm256_set1_epi8(-16);
    uint32_t sign[2];
    std::memcpy(sign, p + 32, 8);
    const __m256i half[2] = {_mm256_and_si256(nibbles, m15),
                             _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), m15)};
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * i),
                          _mm256_add_epi8(half[i], _mm256_and_si256(q5_sign_bytes(sign[i]),
                                                                    minus16)));
#else
    for (int f = 0; f < 64; ++f) out[f] = static_cast<int8_t>(q5_value(p, f));
#endif
  }
}

// Rows [t0, t0 + R) (x: those rows; xsum: their blocks' sums of x, with offsets) against
// features [col, col + 16 NV) of one panel, whose values start at `values` (kInt8: P per k;
// kQ5Bytes: 64 per k; kQ5: 40 bytes per k, col 0, NV 4). R and NV are template constants so the partial sums stay in registers; every (row,
// feature) pair gets the same arithmetic for every R and NV. The accumulators are the result
// itself, read and written once per block (the partial sums take the registers).
//
// Per block of B k, the integers go into a partial sum (x * q, exact integers as floats) and the
// block's scale multiplies that sum once, instead of every weight: one multiply per 16 weights
// fewer, and this loop is bound by vector operations, not by the bytes it reads. The weight a
// sum applies is still exactly gguf's (a unit vector x gives round(q * scale) + offset, as gguf
// rounds); only where the float32 roundings of the sum fall moves, as in any float32 GEMM's
// summation order.
//
// Not inlined: its loop gets the registers to itself, none holding the caller's values.
template <int R, int NV, int B, bool kOffset, Values kV>
[[gnu::noinline]] void tile(const Problem& p, const void* values, const float* x,
                            const float* xsum, int64_t panel, int64_t col, int64_t t0) {
  static_assert(kV != Values::kQ5 || NV == 4, "a 5-bit panel is 64 features, one tile wide");
  // Every loop over rows and vectors unrolled: a partial sum indexed at run time lives in memory.
  const int64_t N = p.N, P = p.P, blocks = p.K / B;
  const int64_t stride = kV == Values::kInt8 ? P : 64;
  float* y = p.y + t0 * N + panel * P + col;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) jaxllm::store(y + r * N + v * kLanes, f32x16{});
  const int8_t* qp = static_cast<const int8_t*>(values) + col;
  const uint8_t* q5 = static_cast<const uint8_t*>(values);
  const float* sp = p.scale + panel * blocks * P + col;
  const float* op = kOffset ? p.offset + panel * blocks * P + col : nullptr;
  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = x + r * p.K;
  for (int64_t b = 0; b < blocks; ++b) {
    f32x16 part[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) part[r][v] = f32x16{};
    for (int64_t k = b * B; k < (b + 1) * B; ++k) {
      f32x16 w[NV];
      if constexpr (kV == Values::kQ5) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
        load_q5(q5 + k * 40, w);
#endif
      } else {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) w[v] = load_q16(qp + k * stride + v * kLanes);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const f32x16 xb = splat(xr[r][k]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) part[r][v] = fma16(xb, w[v], part[r][v]);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      f32x16 sc = load(sp + b * P + v * kLanes);
      if (kV != Values::kInt8) sc = sc * splat(kQ5Unit);
      // The offset multiplies the block's sum of x: sum_k x[k] (q[k] scale + offset).
      const f32x16 of = kOffset ? load(op + b * P + v * kLanes) : f32x16{};
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* acc = y + r * N + v * kLanes;
        f32x16 a = fma16(part[r][v], sc, load(acc));
        if (kOffset) a = fma16(splat(xsum[r * blocks + b]), of, a);
        jaxllm::store(acc, a);
      }
    }
  }
}

// Rows [t0, t0 + R) against a whole panel, vectors_for(R) vectors at a time (4 on AVX-512: 64
// features), fewer where the panel is narrower. A 5-bit panel is one tile of 4 vectors.
template <int R, int B, bool kOffset, Values kV>
void rows_by_panel(const Problem& p, const void* values, const float* x, const float* xsum,
                   int64_t panel, int64_t t0) {
  if constexpr (kV == Values::kQ5) {
    tile<R, 4, B, kOffset, kV>(p, values, x, xsum, panel, 0, t0);
  } else {
    constexpr int kNV = vectors_for(R);
    const int64_t vectors = p.P / kLanes;
    int64_t v = 0;
    for (; v + kNV <= vectors; v += kNV)
      tile<R, kNV, B, kOffset, kV>(p, values, x, xsum, panel, v * kLanes, t0);
    if constexpr (kNV > 2) {
      if (v + 2 <= vectors) {
        tile<R, 2, B, kOffset, kV>(p, values, x, xsum, panel, v * kLanes, t0);
        v += 2;
      }
    }
    if constexpr (kNV > 1) {
      if (v < vectors) tile<R, 1, B, kOffset, kV>(p, values, x, xsum, panel, v * kLanes, t0);
    }
  }
}

// The last `rows` (1 to R) rows of a panel's tiles: one tile of exactly that many.
template <int R, int B, bool kOffset, Values kV>
void rows_left(const Problem& p, const void* values, const float* x, const float* xsum,
               int64_t panel, int64_t t0, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return rows_left<R - 1, B, kOffset, kV>(p, values, x, xsum, panel, t0, rows);
  }
  rows_by_panel<R, B, kOffset, kV>(p, values, x, xsum, panel, t0);
}

// Rows [t0, t1) of x (`x`: those rows) against one panel, in register tiles of up to kTile
// rows, each converting the integer values it needs in registers. (Forming a panel's float32
// weights once into an L1/L2 buffer for all row tiles instead, as a float32 GEMM packs its
// operand, ran slower at 16 to 512 rows: docs/perf/gguf-cpu.md.)
template <int kTile, int B, bool kOffset, Values kV>
void run_tiles(const Problem& p, const void* values, const float* x, const float* xsum,
               int64_t panel, int64_t t0, int64_t t1) {
  const int64_t blocks = p.K / B;
  int64_t t = t0;
  for (; t + kTile <= t1; t += kTile) {
    rows_by_panel<kTile, B, kOffset, kV>(p, values, x + (t - t0) * p.K,
                                         xsum + (t - t0) * blocks, panel, t);
  }
  if constexpr (kTile > 1) {
    if (t < t1)
      rows_left<kTile - 1, B, kOffset, kV>(p, values, x + (t - t0) * p.K,
                                           xsum + (t - t0) * blocks, panel, t, t1 - t);
  }
}

// Rows [t0, t1) against panels [first, last). A 5-bit panel is unpacked in registers for up to
// one tile of rows; for more, once into an int8 buffer that the rows' tiles read as int8
// panels are read, against rows of x times 2^24 (`Values`).
template <int B, bool kOffset, bool kQ5>
void run_item(const Problem& p, int64_t first, int64_t last, int64_t t0, int64_t t1) {
  const float* x = p.x + t0 * p.K;
  // With offsets: each row's sum of x per block, once per item for all its panels (in k order,
  // from x as given).
  thread_local std::vector<float> sums;
  if constexpr (kOffset) {
    const int64_t blocks = p.K / B;
    sums.resize((t1 - t0) * blocks);
    for (int64_t r = 0; r < t1 - t0; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        float sum = 0.0f;
        for (int64_t k = b * B; k < (b + 1) * B; ++k) sum += x[r * p.K + k];
        sums[r * blocks + b] = sum;
      }
    }
  }
  const float* xsum = sums.data();
  if constexpr (!kQ5) {
    for (int64_t panel = first; panel < last; ++panel)
      run_tiles<kRowTile, B, kOffset, Values::kInt8>(p, p.q + panel * p.K * p.P, x, xsum,
                                                     panel, t0, t1);
  } else {
    if constexpr (kQ5InRegisters > 0) {
      if (t1 - t0 <= kQ5InRegisters) {
        for (int64_t panel = first; panel < last; ++panel)
          run_tiles<kQ5InRegisters, B, kOffset, Values::kQ5>(p, p.q5 + panel * p.K * 40, x,
                                                             xsum, panel, t0, t1);
        return;
      }
    }
    // Per worker thread, kept for its next item: a panel's values and the item's rows of x.
    thread_local std::vector<int8_t> values;
    thread_local std::vector<float> scaled;
    values.resize(p.K * 64);
    scaled.resize((t1 - t0) * p.K);
    for (int64_t i = 0; i < (t1 - t0) * p.K; ++i) scaled[i] = x[i] * 16777216.0f;
    for (int64_t panel = first; panel < last; ++panel) {
      unpack_q5(p.q5 + panel * p.K * 40, p.K, values.data());
      run_tiles<kRowTile, B, kOffset, Values::kQ5Bytes>(p, values.data(), scaled.data(), xsum,
                                                        panel, t0, t1);
    }
  }
}

// The block size (a template constant: a runtime one cost an integer division per 16 weights),
// whether the format has offsets, and the layout.
template <bool kQ5>
void run_item(const Problem& p, int64_t B, int64_t first, int64_t last, int64_t t0,
              int64_t t1) {
  if (B == 32) {
    if (p.offset) run_item<32, true, kQ5>(p, first, last, t0, t1);
    else run_item<32, false, kQ5>(p, first, last, t0, t1);
  } else {
    if (p.offset) run_item<16, true, kQ5>(p, first, last, t0, t1);
    else run_item<16, false, kQ5>(p, first, last, t0, t1);
  }
}

// Items of (consecutive panels, block of rows) on the pool and the caller.
template <bool kQ5>
void run(ffi::ThreadPool& pool, const Problem& p, int64_t block, int64_t panel_bytes) {
  const int64_t panels = p.N / p.P;
  const int64_t row_blocks = (p.T + kRowBlock - 1) / kRowBlock;
  // Consecutive panels per item, about 256 KiB of consecutive weights where the weight is large
  // enough (the prefetchers ramp up over a long run; few rows read at memory speed), and about
  // a multiple of the threads in number (near-equal shares when they run equally fast).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t groups = std::max<int64_t>(1, panels * panel_bytes / (256 * 1024));
  groups = (groups + threads - 1) / threads * threads;
  const int64_t per_item = std::max<int64_t>(1, (panels + groups - 1) / groups);
  const int64_t items = (panels + per_item - 1) / per_item;
  // A group's row blocks together (its weights stay in cache between them).
  jaxllm::parallel_for(pool, items * row_blocks,
                       [&p, block, row_blocks, per_item, panels](int64_t i) {
    const int64_t group = i / row_blocks, rb = i % row_blocks;
    const int64_t t0 = rb * kRowBlock, t1 = std::min(p.T, (rb + 1) * kRowBlock);
    run_item<kQ5>(p, block, group * per_item, std::min(panels, (group + 1) * per_item), t0, t1);
  });
}

// The shapes both layouts share: x [T, K], scale (and offset) [N / P, K / B, P] with B 16 or 32;
// an empty string when they hold.
template <ffi::DataType kScale>
const char* check_scales(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<kScale>& scale,
                         const ffi::Buffer<kScale>& offset, bool has_offset, int64_t K) {
  auto xd = x.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  if (xd.size() != 2 || xd[1] != K) return "x must be [T, K] with the weight's K";
  if (sd.size() != 3 || sd[1] == 0 || K % sd[1] != 0 || (K / sd[1] != 16 && K / sd[1] != 32) ||
      (sd[2] != 16 && sd[2] != 32 && sd[2] != 64)) {
    return "scale must be [N / P, K / B, P] with P 16, 32 or 64 and B 16 or 32";
  }
  if (has_offset && (od.size() != 3 || od[0] != sd[0] || od[1] != sd[1] || od[2] != sd[2]))
    return "offset must have scale's shape";
  return "";
}

ffi::Error DequantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                         bool has_offset) {
  auto qd = q.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (qd.size() != 3) return ffi::Error::InvalidArgument("dequant_matmul: q must be [N / P, K, P]");
  if (const char* e = check_scales(x, scale, offset, has_offset, qd[1]); *e)
    return ffi::Error::InvalidArgument(std::string("dequant_matmul: ") + e);
  if (sd[0] != qd[0] || sd[2] != qd[2])
    return ffi::Error::InvalidArgument("dequant_matmul: scale's panels must be q's");
  const int64_t n = qd[0] * qd[2];
  if (yd.size() != 2 || yd[0] != x.dimensions()[0] || yd[1] != n)
    return ffi::Error::InvalidArgument("dequant_matmul: result must be [T, N]");
  const Problem p{x.typed_data(), q.typed_data(), nullptr, scale.typed_data(),
                  has_offset ? offset.typed_data() : nullptr, y->typed_data(),
                  x.dimensions()[0], qd[1], n, qd[2]};
  run<false>(pool, p, qd[1] / sd[1], p.K * p.P);
  return ffi::Error::Success();
}

ffi::Error DequantMatmulQ5(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::U8> q5, ffi::Buffer<ffi::F32> scale,
                           ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                           bool has_offset) {
  auto qd = q5.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (qd.size() != 3 || qd[2] != 40)
    return ffi::Error::InvalidArgument("dequant_matmul: q5 must be [N / 64, K, 40]");
  if (const char* e = check_scales(x, scale, offset, has_offset, qd[1]); *e)
    return ffi::Error::InvalidArgument(std::string("dequant_matmul: ") + e);
  if (sd[0] != qd[0] || sd[2] != 64)
    return ffi::Error::InvalidArgument("dequant_matmul: q5's scale must be [N / 64, K / B, 64]");
  const int64_t n = qd[0] * 64;
  if (yd.size() != 2 || yd[0] != x.dimensions()[0] || yd[1] != n)
    return ffi::Error::InvalidArgument("dequant_matmul: result must be [T, N]");
  const Problem p{x.typed_data(), nullptr, q5.typed_data(), scale.typed_data(),
                  has_offset ? offset.typed_data() : nullptr, y->typed_data(),
                  x.dimensions()[0], qd[1], n, 64};
  run<true>(pool, p, qd[1] / sd[1], p.K * 40);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Opt-in integer path (the engine's cpu_int8_activations), as llama.cpp computes: each row of x
// quantized to int8 per block of 32 (d = max |x| / 127, xq = round(x / d)), the weights' integer
// values multiplied by xq in integer dot products, and per weight block y += d * scale * (sum(xq
// * u) - zero * sum(xq)) + d * sum(xq) * offset. Not exact: x is rounded to 8 bits (a relative
// error of up to 1/254 of the block's largest value per element) and the scales to float16, so
// logits move a little from the exact path's. VNNI does 4 multiply-adds of bytes per 32-bit lane
// in one instruction (AVX2 in three) where the float path widens, converts and FMAs per weight:
// fewer vector operations per weight, which is what decides once the weights come from cache,
// or on AVX2 even from memory (BENCHMARKS.md).
//
// Layouts (cpu_dequant_matmul.pack_int8), per panel of P features and 4 consecutive k (a quad):
// the quad's P x 4 values feature-major, 4 k of a feature side by side in one 32-bit lane, so
// one vector is kW features x 4 k and the rows' 4 bytes of xq are a broadcast 32-bit value.
// - bytes [N / P, K / 4, P, 4]: unsigned (u = q + zero, 0..127: maddubs' pair sums cannot
//   saturate), the zero folded into the offset at packing, or signed int8 (Q8_0, and fused rows
//   of signed and offset formats), which both instructions need turned into unsigned x signed
//   products (dot_signed);
// - nibble-packed (P = 64, values of 4 to 6 bits: Q4_K, Q5_K, Q6_K, Q5_0, Q4_0) [N / 64, K / 4,
//   128 + 32 (bits - 4)]: per quad 128 bytes, byte i holding value i's low nibble and value
//   i + 128's in its high half, then a plane per bit above the fourth, byte i's bit b value
//   32 b + i's. A weight is read at its own width (plus its block's scale), as llama.cpp reads
//   its blocks, rather than at 8 bits; signed formats are stored as q + zero (zero = 2^(bits -
//   1)), and zero * sum(xq) comes off each block's integer sum.
// Scales and offsets: float16 [N / P, K / B, P].
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXLLM_INT8_DOT 1
namespace i8 {
using IVec = __m512i;
using FVec = __m512;
constexpr int kW = 16;       // features per vector
constexpr int kMaxRows = 4;  // 16 accumulators + 4 broadcasts + a weight vector of 32 zmm
constexpr int vectors_for(int) { return 4; }
// Nibble-packed panels: rows up to which a quad unpacks in registers (more unpack the panel once
// into bytes), and tiles per quad (each takes the vectors of its share of the nibble bytes).
constexpr int kPackedRows = 2;
constexpr int kPackedTiles = 1;
inline IVec zero() { return _mm512_setzero_si512(); }
inline IVec load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec splat32(int32_t v) { return _mm512_set1_epi32(v); }
inline IVec dot(IVec acc, IVec u, IVec x) { return _mm512_dpbusd_epi32(acc, u, x); }
// w + 128 is unsigned; the 128 * sum(xq) that adds comes off at the block's end (kSignedBias).
constexpr int32_t kSignedBias = 128;
inline IVec dot_signed(IVec acc, IVec w, IVec x) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), x);
}
inline IVec sub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec fload(const float* p) { return _mm512_loadu_ps(p); }
inline FVec hload(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void fstore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec fsplat(float v) { return _mm512_set1_ps(v); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(uint8_t* p, IVec v) { _mm512_storeu_si512(p, v); }

// A nibble-packed quad's planes, each in both halves of a register (a vector of 64 values
// takes two planes' bits: its first 32 values' and its last 32's).
inline IVec load_plane(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Vector v (values 64 v .. 64 v + 63) of a nibble-packed quad: the nibbles of bytes 64 (v % 2)
// on, low halves for v < 2; each plane's bit 2 v (first 32 values) or 2 v + 1 (last 32) added
// as 16 << plane where set.
template <int kBits>
inline IVec packed_vector(const uint8_t* quad, const IVec* planes, int v) {
  const IVec nib = load(quad + 64 * (v % 2));
  const IVec m15 = _mm512_set1_epi8(15);
  IVec u = v < 2 ? _mm512_and_si512(nib, m15) : _mm512_and_si512(_mm512_srli_epi16(nib, 4), m15);
  const IVec select = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * v))),
                                         _mm256_set1_epi8(static_cast<char>(2 << (2 * v))), 1);
#pragma GCC unroll 2
  for (int plane = 0; plane < kBits - 4; ++plane) {
    const __mmask64 set = _mm512_test_epi8_mask(planes[plane], select);
    u = _mm512_mask_add_epi8(u, set, u, _mm512_set1_epi8(static_cast<char>(16 << plane)));
  }
  return u;
}
}  // namespace i8
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXLLM_INT8_DOT 1
namespace i8 {
using IVec = __m256i;
using FVec = __m256;
constexpr int kW = 8;
// 16 ymm: one row takes 8 accumulators (a 64-feature panel), two rows 2 x 4, plus the
// broadcasts, a weight vector, the maddubs temporaries and the ones.
constexpr int kMaxRows = 2;
constexpr int vectors_for(int R) { return R == 1 ? 8 : 4; }
// Nibble-packed panels: rows up to which a quad unpacks in registers (more unpack the panel once
// into bytes), and tiles per quad (each takes the vectors of its share of the nibble bytes: 8
// accumulators and the unpacking's registers do not fit 16 ymm).
constexpr int kPackedRows = 1;
constexpr int kPackedTiles = 2;
inline IVec zero() { return _mm256_setzero_si256(); }
inline IVec load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec splat32(int32_t v) { return _mm256_set1_epi32(v); }
// maddubs: pairs of u8 x s8 into int16 (at most 2 * 128 * 127: no saturation for u <= 128),
// madd with ones: pairs of those into int32.
inline IVec dot(IVec acc, IVec u, IVec x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x),
                                                 _mm256_set1_epi16(1)));
}
// |w| (<= 128) times x with w's sign: w * x again, as unsigned x signed.
constexpr int32_t kSignedBias = 0;
inline IVec dot_signed(IVec acc, IVec w, IVec x) {
  return dot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
inline IVec sub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline FVec hload(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec fsplat(float v) { return _mm256_set1_ps(v); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(uint8_t* p, IVec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

inline IVec load_plane(const uint8_t* p) { return load(p); }
// Vector v (values 32 v .. 32 v + 31) of a nibble-packed quad: the nibbles of bytes 32 (v % 4)
// on, low halves for v < 4; each plane's bit v moved to bit 4 + plane (16-bit shifts: the bits
// they carry across a byte are masked off).
template <int kBits>
inline IVec packed_vector(const uint8_t* quad, const IVec* planes, int v) {
  const IVec nib = load(quad + 32 * (v % 4));
  const IVec m15 = _mm256_set1_epi8(15);
  IVec u = v < 4 ? _mm256_and_si256(nib, m15) : _mm256_and_si256(_mm256_srli_epi16(nib, 4), m15);
#pragma GCC unroll 2
  for (int plane = 0; plane < kBits - 4; ++plane) {
    const int shift = 4 + plane - v;
    const IVec moved = shift >= 0 ? _mm256_slli_epi16(planes[plane], shift)
                                  : _mm256_srli_epi16(planes[plane], -shift);
    u = _mm256_or_si256(u, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(16 << plane))));
  }
  return u;
}
}  // namespace i8
#endif

#if defined(JAXLLM_INT8_DOT)
constexpr int64_t kQuantBlock = 32;  // x values per activation scale
constexpr int64_t kQuadValues = 256;  // values per quad of a 64-feature panel
constexpr int kQuadVectors = kQuadValues / (i8::kW * 4);
constexpr int kPackedVectors = kQuadVectors / i8::kPackedTiles;  // vectors per packed tile
// Vector i of nibble-packed tile `tile`: the low and high halves of its share of the quad's
// nibble vectors (vector v's nibbles are nibble vector v % (kQuadVectors / 2)'s).
constexpr int packed_vector_index(int tile, int i) {
  constexpr int nibble_vectors = kQuadVectors / 2, per_tile = nibble_vectors / i8::kPackedTiles;
  return tile * per_tile + i % per_tile + i / per_tile * nibble_vectors;
}

struct Int8Problem {
  const int8_t* xq;       // [T, K]
  const float* xscale;    // [T, K / B]: the activation scale d of each weight block
  const float* xoff;      // [T, K / B]: d * the block's sum of xq (the offset's factor)
  const int32_t* xsum;    // [T, K / B]: the block's sum of xq
  const uint8_t* w;       // bytes [N / P, K / 4, P, 4] or nibble-packed [N / 64, K / 4, quad]
  const uint16_t* scale;  // float16 [N / P, K / B, P]
  const uint16_t* offset; // float16 [N / P, K / B, P] or nullptr
  float* y;               // [T, N]
  int64_t T, K, N, P;
  int64_t quad_bytes;     // a nibble-packed quad's bytes (0 for the byte layout)
  int32_t zero;           // nibble-packed: what the stored values exceed q by
};

// Rows [t0, t0 + R) against NV vectors of one panel, whose values start at `values`: vectors
// [v0, v0 + NV) of the byte layout (kBits 8), or those of tile kTile of a nibble-packed panel
// (kBits 4-6, v0 0: packed_vector_index), unpacked in registers per k. The block's integer
// sums stay in registers; y is the float accumulator, read and written once per block.
template <int R, int NV, int B, int kBits, bool kSigned, bool kOffset, int kTile = 0>
[[gnu::noinline]] void int8_tile(const Int8Problem& p, const uint8_t* values, int64_t panel,
                                 int64_t v0, int64_t t0) {
  using namespace i8;
  static_assert(kBits == 8 || NV == kPackedVectors, "a nibble-packed tile is fixed");
  // Where vector i of the tile lies in the panel, in vectors from v0.
  constexpr auto col = [](int i) { return kBits == 8 ? i : packed_vector_index(kTile, i); };
  const int64_t K = p.K, P = p.P, N = p.N, blocks = K / B;
  const uint8_t* w = values + v0 * kW * 4;
  const uint16_t* sp = p.scale + panel * blocks * P + v0 * kW;
  const uint16_t* op = kOffset ? p.offset + panel * blocks * P + v0 * kW : nullptr;
  const int32_t bias = kSigned ? kSignedBias : p.zero;
  float* y = p.y + t0 * N + panel * P + v0 * kW;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) fstore(y + r * N + col(v) * kW, fzero());
  const int8_t* xq = p.xq + t0 * K;
  for (int64_t b = 0; b < blocks; ++b) {
    IVec s[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) s[r][v] = zero();
    for (int64_t k = b * B; k < (b + 1) * B; k += 4) {
      IVec xb[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * K + k, 4);
        xb[r] = splat32(quad);
      }
      if constexpr (kBits == 8) {
        const uint8_t* wk = w + k * P;  // (k / 4) * P * 4
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          const IVec wv = load(wk + v * kW * 4);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            s[r][v] = kSigned ? dot_signed(s[r][v], wv, xb[r]) : dot(s[r][v], wv, xb[r]);
        }
      } else {
        const uint8_t* quad = w + k / 4 * p.quad_bytes;
        IVec planes[kBits - 4 > 0 ? kBits - 4 : 1];
#pragma GCC unroll 2
        for (int plane = 0; plane < kBits - 4; ++plane)
          planes[plane] = load_plane(quad + kQuadValues / 2 + plane * kQuadValues / 8);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          const IVec wv = packed_vector<kBits>(quad, planes, col(v));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) s[r][v] = dot(s[r][v], wv, xb[r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const FVec sc = hload(sp + b * P + col(v) * kW);
      const FVec of = kOffset ? hload(op + b * P + col(v) * kW) : fzero();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (t0 + r) * blocks + b;
        IVec si = s[r][v];
        if (bias) si = sub(si, splat32(bias * p.xsum[rb]));
        float* acc = y + r * N + col(v) * kW;
        FVec a = ffma(to_float(si), fmul(sc, fsplat(p.xscale[rb])), fload(acc));
        if (kOffset) a = ffma(fsplat(p.xoff[rb]), of, a);
        fstore(acc, a);
      }
    }
  }
}

template <int R, int B, int kBits, bool kSigned, bool kOffset>
void int8_rows(const Int8Problem& p, const uint8_t* values, int64_t panel, int64_t t0) {
  if constexpr (kBits < 8) {
    int8_tile<R, kPackedVectors, B, kBits, false, kOffset, 0>(p, values, panel, 0, t0);
    if constexpr (i8::kPackedTiles > 1)
      int8_tile<R, kPackedVectors, B, kBits, false, kOffset, 1>(p, values, panel, 0, t0);
  } else {
    constexpr int kNV = i8::vectors_for(R);
    const int64_t vectors = p.P / i8::kW;
    int64_t v = 0;
    for (; v + kNV <= vectors; v += kNV)
      int8_tile<R, kNV, B, 8, kSigned, kOffset>(p, values, panel, v, t0);
    // Narrower panels (32 or 16 features, rare) one vector at a time.
    for (; v < vectors; ++v) int8_tile<R, 1, B, 8, kSigned, kOffset>(p, values, panel, v, t0);
  }
}

// Rows [t0, t1) against one panel in tiles of kR rows, the last one of exactly those left.
template <int kR, int B, int kBits, bool kSigned, bool kOffset>
void int8_rows_range(const Int8Problem& p, const uint8_t* values, int64_t panel, int64_t t0,
                     int64_t t1) {
  int64_t t = t0;
  for (; t + kR <= t1; t += kR) int8_rows<kR, B, kBits, kSigned, kOffset>(p, values, panel, t);
  if constexpr (kR > 1) {
    if (t < t1) int8_rows_range<kR - 1, B, kBits, kSigned, kOffset>(p, values, panel, t, t1);
  }
}

// A nibble-packed panel's quads -> the byte layout [K / 4, 64, 4] (the values as stored).
template <int kBits>
void unpack_packed(const uint8_t* src, int64_t quads, int64_t quad_bytes, uint8_t* dst) {
  using namespace i8;
  for (int64_t q = 0; q < quads; ++q, src += quad_bytes, dst += kQuadValues) {
    IVec planes[kBits - 4 > 0 ? kBits - 4 : 1];
#pragma GCC unroll 2
    for (int plane = 0; plane < kBits - 4; ++plane)
      planes[plane] = load_plane(src + kQuadValues / 2 + plane * kQuadValues / 8);
#pragma GCC unroll 8
    for (int v = 0; v < kQuadVectors; ++v)
      store(dst + v * kW * 4, packed_vector<kBits>(src, planes, v));
  }
}

// Rows [t0, t1) against panels [first, last). Nibble-packed panels unpack in registers for up
// to kPackedRows rows (each quad read once); for more, once per panel into a byte buffer that
// every tile of rows then reads (unpacking per tile would repeat it per tile).
template <int B, int kBits, bool kSigned, bool kOffset>
void int8_item(const Int8Problem& p, int64_t first, int64_t last, int64_t t0, int64_t t1) {
  constexpr int kR = i8::kMaxRows;
  const int64_t quads = p.K / 4;
  if constexpr (kBits < 8) {
    if (t1 - t0 <= i8::kPackedRows) {
      for (int64_t panel = first; panel < last; ++panel)
        int8_rows_range<i8::kPackedRows, B, kBits, false, kOffset>(
            p, p.w + panel * quads * p.quad_bytes, panel, t0, t1);
      return;
    }
    thread_local std::vector<uint8_t> bytes;
    bytes.resize(quads * kQuadValues);
    for (int64_t panel = first; panel < last; ++panel) {
      unpack_packed<kBits>(p.w + panel * quads * p.quad_bytes, quads, p.quad_bytes, bytes.data());
      int8_rows_range<kR, B, 8, false, kOffset>(p, bytes.data(), panel, t0, t1);
    }
  } else {
    for (int64_t panel = first; panel < last; ++panel)
      int8_rows_range<kR, B, 8, kSigned, kOffset>(p, p.w + panel * p.K * p.P, panel, t0, t1);
  }
}

template <int B, bool kOffset>
void int8_item(const Int8Problem& p, int bits, bool is_signed, int64_t first, int64_t last,
               int64_t t0, int64_t t1) {
  switch (bits) {
    case 4: return int8_item<B, 4, false, kOffset>(p, first, last, t0, t1);
    case 5: return int8_item<B, 5, false, kOffset>(p, first, last, t0, t1);
    case 6: return int8_item<B, 6, false, kOffset>(p, first, last, t0, t1);
    default:
      return is_signed ? int8_item<B, 8, true, kOffset>(p, first, last, t0, t1)
                       : int8_item<B, 8, false, kOffset>(p, first, last, t0, t1);
  }
}

void int8_item(const Int8Problem& p, int64_t B, int bits, bool is_signed, int64_t first,
               int64_t last, int64_t t0, int64_t t1) {
  const bool off = p.offset != nullptr;
  if (B == 32) {
    off ? int8_item<32, true>(p, bits, is_signed, first, last, t0, t1)
        : int8_item<32, false>(p, bits, is_signed, first, last, t0, t1);
  } else {
    off ? int8_item<16, true>(p, bits, is_signed, first, last, t0, t1)
        : int8_item<16, false>(p, bits, is_signed, first, last, t0, t1);
  }
}

// x's rows quantized per block of 32 (llama.cpp's Q8_0 rounding: d = amax / 127, round to
// nearest of x * (1 / d), ties to even here), and per weight block of B its scale, sum of xq and
// d times that sum.
void quantize_rows(const float* x, int64_t T, int64_t K, int64_t B, int8_t* xq, float* xscale,
                   float* xoff, int32_t* xsum) {
  const int64_t blocks = K / B;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; j += kQuantBlock) {
      const float* xs = x + t * K + j;
      float amax = 0.0f;
      bool nan = false;
      for (int64_t i = 0; i < kQuantBlock; ++i) {
        amax = std::max(amax, std::fabs(xs[i]));
        nan |= std::isnan(xs[i]);
      }
      // A NaN in the block makes its scale NaN, so the rows' results are NaN as the exact
      // path's would be, not numbers from a clamped value.
      const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      const float id = d != 0.0f && !nan ? 1.0f / d : 0.0f;
      for (int64_t i = 0; i < kQuantBlock; ++i) {
        const float q = std::nearbyint(xs[i] * id);
        xq[t * K + j + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
      }
      for (int64_t b = j / B; b < (j + kQuantBlock) / B; ++b) {
        int32_t sum = 0;
        for (int64_t i = b * B; i < (b + 1) * B; ++i) sum += xq[t * K + i];
        xsum[t * blocks + b] = sum;
        xscale[t * blocks + b] = d;
        xoff[t * blocks + b] = d * static_cast<float>(sum);
      }
    }
  }
}
#endif  // JAXLLM_INT8_DOT

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset,
                      ffi::ResultBuffer<ffi::F32> y, bool has_offset, int64_t zero) {
#if defined(JAXLLM_INT8_DOT)
  const bool is_signed = w.element_type() == ffi::DataType::S8;
  if (!is_signed && w.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("int8_matmul: w must be uint8 or int8");
  auto wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  int bits = 8;
  int64_t P = 0, quad_bytes = 0;
  if (wd.size() == 4 && wd[3] == 4) {
    P = wd[2];
    if (zero != 0) return ffi::Error::InvalidArgument("int8_matmul: zero is 0 for bytes");
  } else if (wd.size() == 3 && wd[2] >= kQuadValues / 2 &&
             (wd[2] - kQuadValues / 2) % (kQuadValues / 8) == 0 &&
             wd[2] <= kQuadValues / 2 + 2 * (kQuadValues / 8)) {
    P = 64, quad_bytes = wd[2];
    bits = 4 + static_cast<int>((wd[2] - kQuadValues / 2) / (kQuadValues / 8));
    if (zero != (is_signed ? int64_t{1} << (bits - 1) : 0))
      return ffi::Error::InvalidArgument("int8_matmul: zero must be 2^(bits - 1) for int8 "
                                         "nibble-packed values, else 0");
  } else {
    return ffi::Error::InvalidArgument("int8_matmul: w must be [N / P, K / 4, P, 4] bytes or "
                                       "[N / 64, K / 4, 128 + 32 (bits - 4)] nibble-packed");
  }
  const int64_t K = wd[1] * 4, T = x.dimensions()[0];
  if (const char* e = check_scales(x, scale, offset, has_offset, K); *e)
    return ffi::Error::InvalidArgument(std::string("int8_matmul: ") + e);
  if (sd[0] != wd[0] || sd[2] != P || K % kQuantBlock != 0)
    return ffi::Error::InvalidArgument("int8_matmul: scale's panels must be w's, K a multiple "
                                       "of 32");
  const int64_t n = wd[0] * P, B = K / sd[1];
  if (yd.size() != 2 || yd[0] != T || yd[1] != n)
    return ffi::Error::InvalidArgument("int8_matmul: result must be [T, N]");
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xscale, xoff;
  thread_local std::vector<int32_t> xsum;
  xq.resize(T * K);
  xscale.resize(T * (K / B));
  xoff.resize(T * (K / B));
  xsum.resize(T * (K / B));
  quantize_rows(x.typed_data(), T, K, B, xq.data(), xscale.data(), xoff.data(), xsum.data());
  const auto half = [](const ffi::Buffer<ffi::F16>& a) {
    return static_cast<const uint16_t*>(a.untyped_data());
  };
  const Int8Problem p{xq.data(), xscale.data(), xoff.data(), xsum.data(),
                      static_cast<const uint8_t*>(w.untyped_data()), half(scale),
                      has_offset ? half(offset) : nullptr, y->typed_data(), T, K, n, P,
                      quad_bytes, static_cast<int32_t>(zero)};
  // Work items as the float path's (`run`): groups of panels of ~256 KiB, by blocks of rows.
  const int64_t panels = wd[0], row_blocks = (T + kRowBlock - 1) / kRowBlock;
  const int64_t panel_bytes = quad_bytes ? quad_bytes * (K / 4) : K * P;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t groups = std::max<int64_t>(1, panels * panel_bytes / (256 * 1024));
  groups = (groups + threads - 1) / threads * threads;
  const int64_t per_item = std::max<int64_t>(1, (panels + groups - 1) / groups);
  const int64_t items = (panels + per_item - 1) / per_item;
  jaxllm::parallel_for(pool, items * row_blocks,
                       [&p, B, bits, is_signed, row_blocks, per_item, panels](int64_t i) {
    const int64_t group = i / row_blocks, rb = i % row_blocks;
    int8_item(p, B, bits, is_signed, group * per_item, std::min(panels, (group + 1) * per_item),
              rb * kRowBlock, std::min(p.T, (rb + 1) * kRowBlock));
  });
  return ffi::Error::Success();
#else
  (void)pool, (void)x, (void)w, (void)scale, (void)offset, (void)y, (void)has_offset, (void)zero;
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "int8_matmul: this build has neither AVX2 nor AVX-512 VNNI");
#endif
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDequantMatmulQ5, DequantMatmulQ5,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_offset")
                                  .Attr<int64_t>("zero"));
