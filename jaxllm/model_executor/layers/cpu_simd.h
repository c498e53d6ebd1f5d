// 16-lane float32 vectors for our CPU kernels (cpu_ffi.py builds each kernel with this
// directory on the include path and this file in its cache key), with the same per-lane
// arithmetic on every target. The kernels are compiled with -ffp-contract=off: a multiply and
// an add round separately unless fma16 asks for one rounding.
//
// A 16-lane vector is one register on AVX-512 (zmm), two on AVX2 (ymm) and four on NEON or SSE
// (q / xmm): f32x16 holds that many of the target's own vectors (GCC/Clang vector types), which
// the compiler keeps in registers like scalars. (A single 64-byte vector type is not: where the
// target's registers are narrower, GCC keeps such a value in memory between operations.) What
// a 16-lane vector costs in registers differs per target, so the kernels size their register
// tiles from kRegistersPerVector and kVectorRegisters at compile time: a tile that fits
// AVX-512's 32 zmm takes twice the registers on AVX2, which has 16, and spills there.

#ifndef JAXLLM_CPU_SIMD_H_
#define JAXLLM_CPU_SIMD_H_

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace jaxllm {

constexpr int kLanes = 16;

// The target's vector registers: float32 lanes per register and how many registers there are.
#if defined(__AVX512F__)
constexpr int kRegisterLanes = 16, kVectorRegisters = 32;
#elif defined(__AVX__)
constexpr int kRegisterLanes = 8, kVectorRegisters = 16;
#elif defined(__aarch64__)
constexpr int kRegisterLanes = 4, kVectorRegisters = 32;
#else  // SSE2 and other 128-bit targets
constexpr int kRegisterLanes = 4, kVectorRegisters = 16;
#endif
constexpr int kRegistersPerVector = kLanes / kRegisterLanes;
// 16-lane vectors the register file holds at once.
constexpr int kVectorBudget = kVectorRegisters / kRegistersPerVector;

// One register of floats / int32s; the _u types read and write memory at any alignment.
typedef float Reg __attribute__((vector_size(kRegisterLanes * 4)));
typedef int32_t IReg __attribute__((vector_size(kRegisterLanes * 4)));
typedef float RegU __attribute__((vector_size(kRegisterLanes * 4), aligned(4)));

constexpr int kParts = kRegistersPerVector;

// Lane l is part[l / kRegisterLanes][l % kRegisterLanes].
struct f32x16 {
  Reg part[kParts];
  float operator[](int l) const { return part[l / kRegisterLanes][l % kRegisterLanes]; }
};
struct i32x16 {
  IReg part[kParts];
};

#define JAXLLM_PER_PART(r, expr)            \
  _Pragma("GCC unroll 4") for (int i = 0; i < kParts; ++i) r.part[i] = (expr)

inline f32x16 operator+(f32x16 a, f32x16 b) {
  f32x16 r;
  JAXLLM_PER_PART(r, a.part[i] + b.part[i]);
  return r;
}
inline f32x16 operator-(f32x16 a, f32x16 b) {
  f32x16 r;
  JAXLLM_PER_PART(r, a.part[i] - b.part[i]);
  return r;
}
inline f32x16 operator*(f32x16 a, f32x16 b) {
  f32x16 r;
  JAXLLM_PER_PART(r, a.part[i] * b.part[i]);
  return r;
}

inline Reg splat_reg(float v) {
#if defined(__AVX512F__)
  return reinterpret_cast<Reg>(_mm512_set1_ps(v));
#elif defined(__AVX__)
  return reinterpret_cast<Reg>(_mm256_set1_ps(v));
#elif defined(__aarch64__)
  return reinterpret_cast<Reg>(vdupq_n_f32(v));
#else
  return reinterpret_cast<Reg>(_mm_set1_ps(v));
#endif
}

// (Not `f32x16{} + v`: the compiler must then add +0.0f, which is not a no-op for -0.0f.)
inline f32x16 splat(float v) {
  f32x16 r;
  JAXLLM_PER_PART(r, splat_reg(v));
  return r;
}

inline f32x16 load(const float* p) {
  f32x16 r;
  JAXLLM_PER_PART(r, *reinterpret_cast<const RegU*>(p + i * kRegisterLanes));
  return r;
}

inline void store(float* p, f32x16 v) {
  _Pragma("GCC unroll 4") for (int i = 0; i < kParts; ++i)
    *reinterpret_cast<RegU*>(p + i * kRegisterLanes) = v.part[i];
}

// acc + a * b per register, rounded once on every target.
inline Reg fma_reg(Reg a, Reg b, Reg acc) {
#if defined(__AVX512F__)
  return reinterpret_cast<Reg>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                               reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(acc)));
#elif defined(__FMA__)
  return reinterpret_cast<Reg>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                               reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(acc)));
#elif defined(__aarch64__)
  return reinterpret_cast<Reg>(vfmaq_f32(reinterpret_cast<float32x4_t>(acc),
                                         reinterpret_cast<float32x4_t>(a),
                                         reinterpret_cast<float32x4_t>(b)));
#else
  Reg r;
  for (int l = 0; l < kRegisterLanes; ++l) r[l] = __builtin_fmaf(a[l], b[l], acc[l]);
  return r;
#endif
}

inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 acc) {
  f32x16 r;
  JAXLLM_PER_PART(r, fma_reg(a.part[i], b.part[i], acc.part[i]));
  return r;
}

}  // namespace jaxllm

#endif  // JAXLLM_CPU_SIMD_H_
