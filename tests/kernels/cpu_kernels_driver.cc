// A driver for our C++ CPU kernels without XLA, for builds this machine cannot load into JAX
// (aarch64 under qemu-aarch64: tests/kernels/test_cpu_kernels_aarch64.py). Compiled once with
// -DKERNEL_DEQUANT (cpu_dequant_matmul.cc included, its internals called on one thread) and
// once with -DKERNEL_ATTENTION, and linked with main (-DDRIVER_MAIN). Inputs come from a fixed
// generator; each case checks the kernel against a reference computed here and prints a hash of
// its results' bits, which must equal the host build's.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace driver {

struct Rng {
  uint64_t s;
  uint32_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 33);
  }
  float uniform() { return static_cast<float>(next() % 2000001) / 1000000.0f - 1.0f; }
};

inline uint64_t hash(const float* v, size_t n, uint64_t h = 1469598103934665603ull) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, v + i, 4);
    h = (h ^ b) * 1099511628211ull;
  }
  return h;
}

}  // namespace driver

#if defined(KERNEL_DEQUANT)
#include "quantization/cpu_dequant_matmul.cc"

// y = x w^T for panels of P features, blocks of B, with offsets or not: the unit-vector rows
// must give gguf's weights (round(q * scale), + offset) exactly, every row a float64 sum within
// 2e-6 of the sum of |x w|. Returns false on a mismatch, printing the case's hash otherwise.
bool dequant_case(int64_t T, int64_t K, int64_t N, int64_t P, int64_t B, bool offsets,
                  uint64_t seed) {
  driver::Rng rng{seed};
  std::vector<int8_t> q(N * K);  // [N / P, K, P]
  std::vector<float> scale(N / P * (K / B) * P), offset(offsets ? scale.size() : 0);
  for (auto& v : q) v = static_cast<int8_t>(static_cast<int>(rng.next() % 63) - 31);
  for (auto& v : scale) v = rng.uniform() * 0.01f;
  for (auto& v : offset) v = rng.uniform() * 0.1f;
  std::vector<float> x(T * K), y(T * N);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k)
      x[t * K + k] = t < 2 ? (k == (t == 0 ? 3 : K - 1) ? 1.0f : 0.0f) : rng.uniform();
  auto weight = [&](int64_t n, int64_t k) {  // gguf's float32 value
    const int64_t panel = n / P, f = n % P, b = panel * (K / B) * P + (k / B) * P + f;
    float w = static_cast<float>(q[(panel * K + k) * P + f]) * scale[b];
    if (offsets) w = w + offset[b];
    return w;
  };
  const Problem p{x.data(), q.data(), nullptr, scale.data(), offsets ? offset.data() : nullptr,
                  y.data(), T, K, N, P};
  run_item<false>(p, B, 0, N / P, 0, T);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0, bound = 0;
      for (int64_t k = 0; k < K; ++k) {
        ref += static_cast<double>(x[t * K + k]) * weight(n, k);
        bound += std::fabs(static_cast<double>(x[t * K + k]) * weight(n, k));
      }
      const float got = y[t * N + n];
      const bool ok = t < 2 ? got == weight(n, t == 0 ? 3 : K - 1)
                            : std::fabs(got - ref) <= 2e-6 * bound + 1e-30;
      if (!ok) {
        std::printf("dequant T=%ld P=%ld B=%ld: y[%ld, %ld] = %.9g, want %.9g\n", long(T),
                    long(P), long(B), long(t), long(n), got, ref);
        return false;
      }
    }
  std::printf("dequant T=%ld N=%ld P=%ld B=%ld offsets=%d %016llx\n", long(T), long(N), long(P),
              long(B), int(offsets), static_cast<unsigned long long>(driver::hash(y.data(),
                                                                                   y.size())));
  return true;
}

bool run_dequant() {
  bool ok = true;
  uint64_t seed = 1;
  for (int64_t T : {1, 2, 3, 5, 6, 7, 13})
    for (int64_t P : {16, 32, 64})
      for (int64_t B : {16, 32}) ok &= dequant_case(T, 256, 2 * P, P, B, B == 32, seed++);
  return ok;
}
#endif

#if defined(KERNEL_ATTENTION)
#include "cpu_attention.cc"

// One sequence's nq last queries of seq_len keys (blocks of 16 in reverse order), H heads over
// KVH: against float64 softmax attention within 2e-5.
bool attention_case(int64_t H, int64_t KVH, int64_t D, int64_t nq, int64_t seq_len,
                    uint64_t seed) {
  driver::Rng rng{seed};
  const int64_t BS = 16, NB = (seq_len + BS - 1) / BS;
  std::vector<float> q(nq * H * D), kv(2 * KVH * NB * BS * D), out(nq * H * D);
  for (auto& v : q) v = rng.uniform() * 2.0f;
  for (auto& v : kv) v = rng.uniform();
  std::vector<int32_t> tables(NB), seq_lens{static_cast<int32_t>(seq_len)};
  for (int64_t b = 0; b < NB; ++b) tables[b] = static_cast<int32_t>(NB - 1 - b);
  std::vector<int32_t> qsl{0, static_cast<int32_t>(nq)};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Problem p{q.data(), kv.data(), tables.data(), seq_lens.data(), qsl.data(), out.data(),
                  nq, H, D, KVH, NB, BS, 1, NB, 0, scale};
  for (int64_t t0 = 0; t0 < nq; t0 += kQueryTile)
    for (int64_t h = 0; h < KVH; ++h)
      attend_dispatch(p, 0, t0, std::min<int64_t>(kQueryTile, nq - t0), seq_len - nq + t0, h);
  const int64_t G = H / KVH;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t hq = 0; hq < H; ++hq) {
      const int64_t h = hq / G, pos = seq_len - nq + i;
      auto key = [&](int64_t c, int64_t j) {  // cache c (0 keys, 1 values), position j
        return &kv[((c * KVH + h) * NB + tables[j / BS]) * BS * D + (j % BS) * D];
      };
      std::vector<double> logit(pos + 1);
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j <= pos; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(q[(i * H + hq) * D + d]) * key(0, j)[d];
        logit[j] = dot * scale;
        mx = std::max(mx, logit[j]);
      }
      for (auto& v : logit) sum += (v = std::exp(v - mx));
      for (int64_t d = 0; d < D; ++d) {
        double ref = 0;
        for (int64_t j = 0; j <= pos; ++j) ref += logit[j] / sum * key(1, j)[d];
        const float got = out[(i * H + hq) * D + d];
        if (!(std::fabs(got - ref) <= 2e-5 * (1 + std::fabs(ref)))) {
          std::printf("attention D=%ld nq=%ld: out[%ld, %ld, %ld] = %.9g, want %.9g\n", long(D),
                      long(nq), long(i), long(hq), long(d), got, ref);
          return false;
        }
      }
    }
  std::printf("attention H=%ld KVH=%ld D=%ld nq=%ld len=%ld %016llx\n", long(H), long(KVH),
              long(D), long(nq), long(seq_len),
              static_cast<unsigned long long>(driver::hash(out.data(), out.size())));
  return true;
}

bool run_attention() {
  bool ok = true;
  uint64_t seed = 100;
  for (int64_t D : {64, 128, 256})
    for (int64_t nq : {1, 5, 20}) ok &= attention_case(14, 2, D, nq, 70, seed++);
  return ok;
}
#endif

#if defined(DRIVER_MAIN)
bool run_dequant();
bool run_attention();

int main() {
  const bool ok = run_dequant() & run_attention();
  std::printf(ok ? "ok\n" : "FAILED\n");
  return ok ? 0 : 1;
}
#endif
