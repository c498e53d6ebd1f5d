// 16-lane float32 vectors for our CPU kernels (cpu_ffi.py builds each kernel with this
// directory on the include path and this file in its cache key). GCC/Clang vector types,
// compiled to whatever SIMD -march=native has (one zmm on AVX-512, two ymm on AVX2), with the
// same per-lane arithmetic on every target. The kernels are compiled with -ffp-contract=off:
// a multiply and an add round separately unless fma16 asks for one rounding.

#ifndef JAXLLM_CPU_SIMD_H_
#define JAXLLM_CPU_SIMD_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jaxllm {

constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));

// (Not `f32x16{} + v`: the compiler must then add +0.0f, which is not a no-op for -0.0f.)
inline f32x16 splat(float v) {
  return f32x16{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
}

inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// acc + a * b, rounded once where the CPU has FMA.
inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 acc) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                  reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(acc)));
#elif defined(__FMA__)
  typedef float f32x8 __attribute__((vector_size(32)));
  f32x8 x[2], y[2], z[2];
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  std::memcpy(z, &acc, 64);
  for (int i = 0; i < 2; ++i)
    z[i] = reinterpret_cast<f32x8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(x[i]),
                                                   reinterpret_cast<__m256>(y[i]),
                                                   reinterpret_cast<__m256>(z[i])));
  f32x16 r;
  std::memcpy(&r, z, 64);
  return r;
#else
  return a * b + acc;
#endif
}

}  // namespace jaxllm

#endif  // JAXLLM_CPU_SIMD_H_
