// Adam / AdamW over fp32 master shards on the CPU, one pass, SIMD chosen at run time.
//
// [Note: formula order]
// The update reproduces torch.optim.Adam(W)'s single-tensor CPU path operation by
// operation, each rounded to fp32 where torch rounds, so results agree with PyTorch to
// float tolerance:
//   AdamW:  p = p * (1 - lr*wd)
//   Adam:   g = fma(p, wd, g)                      (grad.add(param, alpha=wd), vectorized)
//   m = fma(w, g - m, m)   if w < 0.5             (exp_avg.lerp_(grad, w = 1 - beta1))
//   m = fma(w - 1, g - m, g) otherwise
//   v = v * beta2;  v = fma((1 - beta2) * g, g, v)  (mul_ then addcmul_, which torch's
//                                                  vectorized CPU kernel contracts)
//   denom = sqrt(v) / sqrt(bc2) + eps
//   p = p + (-step_size * m) / denom              (addcdiv_)
// The per-step scalars (1 - lr*wd, lr / bc1, sqrt(bc2), ...) are computed in double and
// then rounded to fp32, as torch does when a Python float meets an fp32 tensor.
// Every SIMD level evaluates exactly these operations (no contraction: we build with
// -ffp-contract=off), so AVX-512, AVX2 and scalar give bit-identical results (NaN payloads
// aside); the ragged tail goes through the vector body on a padded stack copy. The result
// agrees with torch.optim.AdamW(fused=True) to the last bit on nearly every element; the
// default single-tensor path differs in the last bit now and then because its sqrt goes
// through MKL, which is not correctly rounded (ours is).
//
// [Note: dividing by bc2_sqrt]
// A vector division occupies the divider, which also runs the square root, for many cycles:
// with two divisions and a square root per element the divider limits the kernel whenever
// the data is in cache (small tensors, the fused 8-bit step's moments on the stack). The
// division by the per-step constant c = bc2_sqrt is exact without it. With r = RN(1/c)
// (one fp32 division per call):
//   q0 = RN(x * r)                 within 1.5 ulp of x / c
//   q1 = RN(q0 + RN(x - q0 * c) * r)  faithful (the error left is ~2^-22 ulp before rounding)
//   q2 = RN(q1 + (x - q1 * c) * r)    = RN(x / c)   (two fmas)
// The last step is Markstein's theorem: for q faithful and r within half an ulp of 1/c,
// x - q*c is exact and q + (x - q*c) * r rounds to RN(x / c). Here x = sqrt(v) is 0, inf,
// NaN, or in [2^-75, 2^64], and c in [2^-27, 1] (beta2 < 1), so nothing overflows and the
// remainder x - q*c, a multiple of ulp(q) * ulp(c) >= 2^-148, is representable. +0 comes
// through as +0 (x is never -0: v's product term (1 - beta2) * g * g is never negative, so
// the fma that makes v rounds a zero sum to +0); inf and NaN take x itself, which is what
// x / c gives. Tests compare the results bit for bit against float64 arithmetic rounded to
// fp32, over the whole range of v, at every SIMD level.
//
// [Note: streaming stores]
// param, exp_avg and exp_avg_sq are read before they are written, so their cache lines are
// already owned and plain stores cost nothing extra. The optional bf16/fp16 output is only
// written: a plain store would first read each line (read-for-ownership), 2 more bytes per
// element on top of Adam's 28. For large tensors (>= kStreamMin elements, far beyond the
// caches anyway) the output uses non-temporal stores, which skip that read.
//
// [Note: prefetch]
// The vector loops prefetch each input stream (param, grad, exp_avg, exp_avg_sq) a fixed
// number of elements ahead into L1, chosen by CPU vendor at load time. On Intel cores the
// hardware prefetchers stop at every 4 KiB page and start again only after a few misses in
// the next one; with four streams per thread those restarts leave the loads waiting on
// memory, and 512 elements (2 KiB) ahead streams more bytes. On the AMD EPYC cores
// measured, 512 ahead ran slower than no hints at all and 128 elements (512 bytes) ran
// best: their own prefetchers keep up, and hints far ahead seem to cost load slots and
// lines still in use. Other CPUs prefetch nothing. The distances are measured, not
// derived (benchmarks/RESULTS.md, with the sweep); set_prefetch overrides the choice. The
// last `ahead` elements of each range run without hints (none past the end of an array).
// Prefetching changes no result, only when bytes arrive.
//
// [Note: threading]
// Tensors of at least kParallelMin elements are cut into chunks of up to kChunk elements
// (256 KiB per fp32 stream: long enough for the hardware prefetchers, small enough to
// balance; smaller when that would leave threads idle), handed out to OpenMP threads
// dynamically, so a thread slowed by other work on its core (I/O threads of the offload
// pipeline, other processes) does not hold up the rest. The thread count follows
// torch.get_num_threads(). Smaller tensors run on the calling thread: waking a thread
// team costs more than updating them. Results do not depend on the thread count or the
// chunking: every element is computed the same way.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ZT_X86 1
#define ZT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZT_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif

namespace zerotune_adam {

enum class Simd : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum class Lowp : int { kNone = 0, kBF16 = 1, kF16 = 2 };

constexpr int64_t kChunk = 1 << 16;         // elements per OpenMP work item (at most)
constexpr int64_t kMinChunk = 1 << 12;      // ... and at least
constexpr int64_t kParallelMin = 1 << 16;   // below this, run single-threaded
constexpr int64_t kStreamMin = 1 << 20;     // from here the low-precision copy bypasses caches
constexpr int64_t kPrefetchIntel = 512;     // elements ahead of the loads (see [Note: prefetch])
constexpr int64_t kPrefetchAmd = 128;

// Elements ahead of the loads that the vector loops prefetch, 0 for none: see [Note:
// prefetch]. set_prefetch changes it (benchmarks, tests).
int64_t detect_prefetch() {
#ifdef ZT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return kPrefetchIntel;
  if (__builtin_cpu_is("amd")) return kPrefetchAmd;
#endif
  return 0;
}
const int64_t kPrefetchDetected = detect_prefetch();
int64_t g_prefetch = kPrefetchDetected;

struct Coeffs {
  bool decoupled;     // AdamW: multiply param by `decay`
  bool l2;            // Adam: add `wd * param` to the grad
  bool lerp_small;    // torch's lerp picks its formula by |weight| < 0.5
  float decay;        // fp32(1 - lr * wd)
  float wd;           // fp32(wd)
  float lerp_coeff;   // w if lerp_small else w - 1, with w = fp32(1 - beta1)
  float beta2;        // fp32(beta2)
  float one_minus_beta2;
  float bc2_sqrt;     // fp32(sqrt(1 - beta2**step)), 1 without bias correction
  float bc2_rcp;      // fp32(1 / bc2_sqrt), rounded to nearest (see [Note: dividing by bc2_sqrt])
  float eps;
  float neg_step;     // fp32(-(lr / (1 - beta1**step)))
  bool stream_out;    // write the low-precision copy with streaming stores
};

// ---------------------------------------------------------------------------------
// Scalar level. Also the semantic reference for the vector levels.

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float f16_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
inline uint16_t float_to_bf16(float f) {
  return c10::BFloat16(f).x;  // round to nearest even, NaN -> quiet NaN
}
inline uint16_t float_to_f16(float f) {
  return c10::Half(f).x;  // round to nearest even
}

template <typename G>
inline float load_grad_scalar(const G* g, int64_t i);
template <>
inline float load_grad_scalar<float>(const float* g, int64_t i) { return g[i]; }
template <>
inline float load_grad_scalar<c10::BFloat16>(const c10::BFloat16* g, int64_t i) {
  return bf16_to_float(g[i].x);
}
template <>
inline float load_grad_scalar<c10::Half>(const c10::Half* g, int64_t i) {
  return f16_to_float(g[i].x);
}

template <typename G, Lowp O>
void adam_scalar(float* p, const G* g, float* m, float* v, uint16_t* out, int64_t n,
                 const Coeffs& c) {
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    float gi = load_grad_scalar<G>(g, i);
    if (c.l2) gi = std::fma(pi, c.wd, gi);
    if (c.decoupled) pi = pi * c.decay;
    float mi = m[i];
    const float diff = gi - mi;
    mi = std::fma(c.lerp_coeff, diff, c.lerp_small ? mi : gi);
    float vi = v[i] * c.beta2;
    vi = std::fma(c.one_minus_beta2 * gi, gi, vi);
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    pi = pi + (c.neg_step * mi) / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (O == Lowp::kBF16) out[i] = float_to_bf16(pi);
    if constexpr (O == Lowp::kF16) out[i] = float_to_f16(pi);
  }
}

// ---------------------------------------------------------------------------------
// AVX2 + FMA + F16C level: 8 lanes.

#ifdef ZT_X86

template <typename G>
ZT_AVX2 inline __m256 load_grad8(const G* g);
template <>
ZT_AVX2 inline __m256 load_grad8<float>(const float* g) { return _mm256_loadu_ps(g); }
template <>
ZT_AVX2 inline __m256 load_grad8<c10::BFloat16>(const c10::BFloat16* g) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
template <>
ZT_AVX2 inline __m256 load_grad8<c10::Half>(const c10::Half* g) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
}

// fp32 -> bf16 round-to-nearest-even on integers (no AVX512-BF16 needed); NaN -> 0x7fc0.
ZT_AVX2 inline __m128i float8_to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <Lowp O, bool kStream>
ZT_AVX2 inline void store_lowp8(uint16_t* out, __m256 x) {
  __m128i h;
  if constexpr (O == Lowp::kBF16) {
    h = float8_to_bf16(x);
  } else {
    h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if constexpr (kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), h);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
  }
}

// See [Note: prefetch]. One call per 16 elements: one cache line of each fp32 stream.
template <typename G>
inline void prefetch_ahead(const float* p, const G* g, const float* m, const float* v,
                           int64_t ahead) {
  _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(g + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(m + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(v + ahead), _MM_HINT_T0);
}

struct Vec8Coeffs {
  __m256 decay, wd, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, bc2_rcp, eps, neg_step;
};

// x / bc2_sqrt rounded to nearest, without a division: see [Note: dividing by bc2_sqrt].
ZT_AVX2 inline __m256 div_bc2_8(__m256 x, const Vec8Coeffs& k) {
  __m256 q = _mm256_mul_ps(x, k.bc2_rcp);
  q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, k.bc2_sqrt, x), k.bc2_rcp, q);  // faithful
  q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, k.bc2_sqrt, x), k.bc2_rcp, q);  // correctly rounded
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ);
  return _mm256_blendv_ps(q, x, keep);  // x / c is x for inf and NaN
}

template <typename G, Lowp O, bool kStream>
ZT_AVX2 inline void adam8(float* p, const G* g, float* m, float* v, uint16_t* out,
                          const Coeffs& c, const Vec8Coeffs& k) {
  __m256 pv = _mm256_loadu_ps(p);
  __m256 gv = load_grad8<G>(g);
  __m256 mv = _mm256_loadu_ps(m);
  __m256 vv = _mm256_loadu_ps(v);
  if (c.l2) gv = _mm256_fmadd_ps(pv, k.wd, gv);
  if (c.decoupled) pv = _mm256_mul_ps(pv, k.decay);
  const __m256 diff = _mm256_sub_ps(gv, mv);
  mv = _mm256_fmadd_ps(k.lerp_coeff, diff, c.lerp_small ? mv : gv);
  vv = _mm256_mul_ps(vv, k.beta2);
  vv = _mm256_fmadd_ps(_mm256_mul_ps(k.one_minus_beta2, gv), gv, vv);
  const __m256 denom = _mm256_add_ps(div_bc2_8(_mm256_sqrt_ps(vv), k), k.eps);
  pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(k.neg_step, mv), denom));
  _mm256_storeu_ps(p, pv);
  _mm256_storeu_ps(m, mv);
  _mm256_storeu_ps(v, vv);
  if constexpr (O != Lowp::kNone) store_lowp8<O, kStream>(out, pv);
}

template <typename G, Lowp O, bool kStream>
ZT_AVX2 void adam_avx2_impl(float* p, const G* g, float* m, float* v, uint16_t* out, int64_t n,
                            const Coeffs& c) {
  const Vec8Coeffs k{_mm256_set1_ps(c.decay),      _mm256_set1_ps(c.wd),
                     _mm256_set1_ps(c.lerp_coeff), _mm256_set1_ps(c.beta2),
                     _mm256_set1_ps(c.one_minus_beta2), _mm256_set1_ps(c.bc2_sqrt),
                     _mm256_set1_ps(c.bc2_rcp),    _mm256_set1_ps(c.eps),
                     _mm256_set1_ps(c.neg_step)};
  const int64_t ahead = g_prefetch;
  int64_t i = 0;
  for (; i + ahead + 16 <= n; i += 16) {
    if (ahead) prefetch_ahead(p + i, g + i, m + i, v + i, ahead);
    adam8<G, O, kStream>(p + i, g + i, m + i, v + i, out + i, c, k);
    adam8<G, O, kStream>(p + i + 8, g + i + 8, m + i + 8, v + i + 8, out + i + 8, c, k);
  }
  for (; i + 16 <= n; i += 16) {
    adam8<G, O, kStream>(p + i, g + i, m + i, v + i, out + i, c, k);
    adam8<G, O, kStream>(p + i + 8, g + i + 8, m + i + 8, v + i + 8, out + i + 8, c, k);
  }
  for (; i + 8 <= n; i += 8) adam8<G, O, kStream>(p + i, g + i, m + i, v + i, out + i, c, k);
  if (i < n) {  // ragged tail: same vector code on a zero-padded copy
    const int64_t r = n - i;
    alignas(32) float pb[8] = {}, mb[8] = {}, vb[8] = {};
    alignas(32) G gb[8] = {};
    alignas(32) uint16_t ob[8] = {};
    std::memcpy(pb, p + i, r * sizeof(float));
    std::memcpy(gb, g + i, r * sizeof(G));
    std::memcpy(mb, m + i, r * sizeof(float));
    std::memcpy(vb, v + i, r * sizeof(float));
    adam8<G, O, false>(pb, gb, mb, vb, ob, c, k);
    std::memcpy(p + i, pb, r * sizeof(float));
    std::memcpy(m + i, mb, r * sizeof(float));
    std::memcpy(v + i, vb, r * sizeof(float));
    if constexpr (O != Lowp::kNone) std::memcpy(out + i, ob, r * sizeof(uint16_t));
  }
}

template <typename G, Lowp O>
ZT_AVX2 void adam_avx2(float* p, const G* g, float* m, float* v, uint16_t* out, int64_t n,
                       const Coeffs& c) {
  if constexpr (O != Lowp::kNone) {
    if (c.stream_out && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
      adam_avx2_impl<G, O, true>(p, g, m, v, out, n, c);
      _mm_sfence();  // streaming stores are weakly ordered; publish before returning
      return;
    }
  }
  adam_avx2_impl<G, O, false>(p, g, m, v, out, n, c);
}

// ---------------------------------------------------------------------------------
// AVX-512F level: 16 lanes. Uses only AVX512F instructions (bf16 rounding on integers,
// fp16 through vcvtps2ph), so it runs on every AVX-512 CPU.

template <typename G>
ZT_AVX512 inline __m512 load_grad16(const G* g);
template <>
ZT_AVX512 inline __m512 load_grad16<float>(const float* g) { return _mm512_loadu_ps(g); }
template <>
ZT_AVX512 inline __m512 load_grad16<c10::BFloat16>(const c10::BFloat16* g) {
  const __m512i w =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <>
ZT_AVX512 inline __m512 load_grad16<c10::Half>(const c10::Half* g) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
}

template <Lowp O, bool kStream>
ZT_AVX512 inline void store_lowp16(uint16_t* out, __m512 x) {
  __m256i h;
  if constexpr (O == Lowp::kBF16) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    h = _mm512_cvtepi32_epi16(r);
  } else {
    h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out), h);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  }
}

struct Vec16Coeffs {
  __m512 decay, wd, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, bc2_rcp, eps, neg_step;
};

// x / bc2_sqrt rounded to nearest, without a division: see [Note: dividing by bc2_sqrt].
ZT_AVX512 inline __m512 div_bc2_16(__m512 x, const Vec16Coeffs& k) {
  __m512 q = _mm512_mul_ps(x, k.bc2_rcp);
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, k.bc2_sqrt, x), k.bc2_rcp, q);  // faithful
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, k.bc2_sqrt, x), k.bc2_rcp, q);  // correctly rounded
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
  return _mm512_mask_mov_ps(q, keep, x);  // x / c is x for inf and NaN
}

template <typename G, Lowp O, bool kStream>
ZT_AVX512 inline void adam16(float* p, const G* g, float* m, float* v, uint16_t* out,
                             const Coeffs& c, const Vec16Coeffs& k) {
  __m512 pv = _mm512_loadu_ps(p);
  __m512 gv = load_grad16<G>(g);
  __m512 mv = _mm512_loadu_ps(m);
  __m512 vv = _mm512_loadu_ps(v);
  if (c.l2) gv = _mm512_fmadd_ps(pv, k.wd, gv);
  if (c.decoupled) pv = _mm512_mul_ps(pv, k.decay);
  const __m512 diff = _mm512_sub_ps(gv, mv);
  mv = _mm512_fmadd_ps(k.lerp_coeff, diff, c.lerp_small ? mv : gv);
  vv = _mm512_mul_ps(vv, k.beta2);
  vv = _mm512_fmadd_ps(_mm512_mul_ps(k.one_minus_beta2, gv), gv, vv);
  const __m512 denom = _mm512_add_ps(div_bc2_16(_mm512_sqrt_ps(vv), k), k.eps);
  pv = _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(k.neg_step, mv), denom));
  _mm512_storeu_ps(p, pv);
  _mm512_storeu_ps(m, mv);
  _mm512_storeu_ps(v, vv);
  if constexpr (O != Lowp::kNone) store_lowp16<O, kStream>(out, pv);
}

template <typename G, Lowp O, bool kStream>
ZT_AVX512 void adam_avx512_impl(float* p, const G* g, float* m, float* v, uint16_t* out,
                                int64_t n, const Coeffs& c) {
  const Vec16Coeffs k{_mm512_set1_ps(c.decay),      _mm512_set1_ps(c.wd),
                      _mm512_set1_ps(c.lerp_coeff), _mm512_set1_ps(c.beta2),
                      _mm512_set1_ps(c.one_minus_beta2), _mm512_set1_ps(c.bc2_sqrt),
                      _mm512_set1_ps(c.bc2_rcp),    _mm512_set1_ps(c.eps),
                      _mm512_set1_ps(c.neg_step)};
  const int64_t ahead = g_prefetch;
  int64_t i = 0;
  for (; i + ahead + 16 <= n; i += 16) {
    if (ahead) prefetch_ahead(p + i, g + i, m + i, v + i, ahead);
    adam16<G, O, kStream>(p + i, g + i, m + i, v + i, out + i, c, k);
  }
  for (; i + 16 <= n; i += 16) {
    adam16<G, O, kStream>(p + i, g + i, m + i, v + i, out + i, c, k);
  }
  if (i < n) {
    const int64_t r = n - i;
    alignas(64) float pb[16] = {}, mb[16] = {}, vb[16] = {};
    alignas(64) G gb[16] = {};
    alignas(64) uint16_t ob[16] = {};
    std::memcpy(pb, p + i, r * sizeof(float));
    std::memcpy(gb, g + i, r * sizeof(G));
    std::memcpy(mb, m + i, r * sizeof(float));
    std::memcpy(vb, v + i, r * sizeof(float));
    adam16<G, O, false>(pb, gb, mb, vb, ob, c, k);
    std::memcpy(p + i, pb, r * sizeof(float));
    std::memcpy(m + i, mb, r * sizeof(float));
    std::memcpy(v + i, vb, r * sizeof(float));
    if constexpr (O != Lowp::kNone) std::memcpy(out + i, ob, r * sizeof(uint16_t));
  }
}

template <typename G, Lowp O>
ZT_AVX512 void adam_avx512(float* p, const G* g, float* m, float* v, uint16_t* out, int64_t n,
                           const Coeffs& c) {
  if constexpr (O != Lowp::kNone) {
    if (c.stream_out && reinterpret_cast<uintptr_t>(out) % 32 == 0) {
      adam_avx512_impl<G, O, true>(p, g, m, v, out, n, c);
      _mm_sfence();
      return;
    }
  }
  adam_avx512_impl<G, O, false>(p, g, m, v, out, n, c);
}

#endif  // ZT_X86

// ---------------------------------------------------------------------------------
// Run-time dispatch.

Simd detect_simd() {
#ifdef ZT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Simd::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Simd::kAvx2;
  }
#endif
  return Simd::kScalar;
}

const Simd kDetected = detect_simd();
Simd g_simd = kDetected;  // may be lowered by set_simd_level (tests, debugging)

const char* simd_name(Simd s) {
  switch (s) {
    case Simd::kAvx512: return "avx512";
    case Simd::kAvx2: return "avx2";
    default: return "scalar";
  }
}

template <typename G, Lowp O>
void adam_range(float* p, const G* g, float* m, float* v, uint16_t* out, int64_t n,
                const Coeffs& c, Simd simd) {
#ifdef ZT_X86
  if (simd == Simd::kAvx512) return adam_avx512<G, O>(p, g, m, v, out, n, c);
  if (simd == Simd::kAvx2) return adam_avx2<G, O>(p, g, m, v, out, n, c);
#endif
  adam_scalar<G, O>(p, g, m, v, out, n, c);
}

int team_size() {
  int nt = at::get_num_threads();
#ifdef _OPENMP
  if (omp_in_parallel()) nt = 1;  // already inside someone's team: do not nest
#endif
  return std::max(nt, 1);
}

// Calls fn(begin, end) over [0, n): chunks across threads, or inline when small.
template <typename Fn>
void for_each_chunk(int64_t n, const Fn& fn) {
  const int nt = team_size();
  if (n < kParallelMin || nt == 1) {
    fn(int64_t{0}, n);
    return;
  }
  // Mid-sized tensors get smaller chunks so that every thread has one; chunk starts stay
  // multiples of 64 elements (aligned vectors and streaming stores).
  const int64_t per_thread = ((n + nt - 1) / nt + 63) / 64 * 64;
  const int64_t chunk = std::clamp(per_thread, kMinChunk, kChunk);
  const int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int64_t begin = ci * chunk;
    fn(begin, std::min(n, begin + chunk));
  }
}

template <typename G, Lowp O>
void adam_all(float* p, const G* g, float* m, float* v, uint16_t* out, int64_t n,
              const Coeffs& c) {
  const Simd simd = g_simd;
  for_each_chunk(n, [&](int64_t b, int64_t e) {
    adam_range<G, O>(p + b, g + b, m + b, v + b, out ? out + b : nullptr, e - b, c, simd);
  });
}

template <typename G>
void adam_dispatch_out(float* p, const G* g, float* m, float* v, uint16_t* out, Lowp lowp,
                       int64_t n, const Coeffs& c) {
  switch (lowp) {
    case Lowp::kBF16: return adam_all<G, Lowp::kBF16>(p, g, m, v, out, n, c);
    case Lowp::kF16: return adam_all<G, Lowp::kF16>(p, g, m, v, out, n, c);
    default: return adam_all<G, Lowp::kNone>(p, g, m, v, nullptr, n, c);
  }
}

Coeffs make_coeffs(int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, bool adamw, bool bias_correction) {
  // Double precision on the host, then fp32, as in torch.optim (see [Note: formula order]).
  Coeffs c{};
  c.decoupled = adamw && weight_decay != 0.0;
  c.l2 = !adamw && weight_decay != 0.0;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.wd = static_cast<float>(weight_decay);
  const float w = static_cast<float>(1.0 - beta1);
  c.lerp_small = std::abs(w) < 0.5f;
  c.lerp_coeff = c.lerp_small ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.bc2_rcp = 1.0f / c.bc2_sqrt;
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-(lr / bc1));
  return c;
}

void check_f32(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, param has ", n);
}

void check_grad(const at::Tensor& grad, int64_t n) {
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n,
              "grad must be a contiguous CPU tensor with ", n, " elements");
}

// f(the gradient's data as const float*, c10::BFloat16* or c10::Half*).
template <typename F>
void with_grad_data(const at::Tensor& grad, F&& f) {
  switch (grad.scalar_type()) {
    case at::kFloat: return f(grad.const_data_ptr<float>());
    case at::kBFloat16: return f(grad.const_data_ptr<c10::BFloat16>());
    case at::kHalf: return f(grad.const_data_ptr<c10::Half>());
    default:
      TORCH_CHECK(false, "grad must be float32, bfloat16 or float16, got ", grad.scalar_type());
  }
}

// The optional bf16/fp16 copy of the updated parameters: its kind and its data (kNone and
// null without one).
std::pair<Lowp, uint16_t*> lowp_out(const std::optional<at::Tensor>& out, int64_t n) {
  if (!out.has_value() || !out->defined()) return {Lowp::kNone, nullptr};
  const at::Tensor& o = *out;
  TORCH_CHECK(o.device().is_cpu() && o.is_contiguous() && o.numel() == n,
              "out must be a contiguous CPU tensor with ", n, " elements");
  TORCH_CHECK(o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf,
              "out must be bfloat16 or float16, got ", o.scalar_type());
  return {o.scalar_type() == at::kBFloat16 ? Lowp::kBF16 : Lowp::kF16,
          reinterpret_cast<uint16_t*>(o.data_ptr())};
}

void adam_update(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                 std::optional<at::Tensor> out, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay, bool adamw,
                 bool bias_correction) {
  const int64_t n = param.numel();
  check_f32(param, "param", n);
  check_f32(exp_avg, "exp_avg", n);
  check_f32(exp_avg_sq, "exp_avg_sq", n);
  check_grad(grad, n);
  TORCH_CHECK(step >= 1, "step must be >= 1, got ", step);
  Lowp lowp;
  uint16_t* outp;
  std::tie(lowp, outp) = lowp_out(out, n);
  if (n == 0) return;
  Coeffs c = make_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction);
  c.stream_out = n >= kStreamMin;
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  with_grad_data(grad, [&](const auto* g) { adam_dispatch_out(p, g, m, v, outp, lowp, n, c); });
}

// ---------------------------------------------------------------------------------
// Adam over 8-bit moments (see [Note: fused 8-bit step]).

// csrc/adam/quant8.cpp
void q8_check_moment(const at::Tensor& q, const at::Tensor& absmax, int64_t n,
                     const char* q_name, const char* absmax_name);
void q8_dequantize_block(const float* code, const uint8_t* q, int64_t len, float absmax,
                         float* out, bool vec);
const void* q8_table(const at::Tensor& code);
void q8_quantize_block(const void* table, const float* x, int64_t len, float* absmax,
                       uint8_t* q, bool vec);

// [Note: fused 8-bit step]
// With 8-bit moments the update is dequantize -> Adam -> quantize. Done as three passes
// over a chunk, the fp32 moments go through memory three times (8 bytes per element
// written, read, written and read again: ~32 bytes per element beyond the update's own).
// Here each block of 256 is dequantized into two arrays on the stack, updated by the same
// `adam_range` as fp32 moments (per parameter-group segment that overlaps the block, each
// with its own coefficients), and quantized back at once, so the moments stay in L1. Each
// step is the same operation as in the three-pass path, so the bytes are the same (tests
// compare them at every SIMD level). Elements outside every segment (padding, a parameter
// without a gradient this step) are dequantized and quantized again like the rest of their
// block, as the three passes do; a block no segment reaches is not touched at all (a
// round trip through the codes is not exact: it would move moments nothing updated).
struct Q8Side {
  uint8_t* q;
  float* absmax;
  const float* code;
  const void* table;
};

template <typename G, Lowp O>
void adam8bit_all(float* p, const G* g, uint16_t* out, int64_t n, const Q8Side& qm,
                  const Q8Side& qv, const std::vector<int64_t>& bounds,
                  const std::vector<Coeffs>& coeffs) {
  constexpr int64_t kBlock = 256, kGroup = 64;  // blocks per work item: 16K elements
  const Simd simd = g_simd;
  const bool vec = simd != Simd::kScalar;
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  const int64_t ngroups = (nblocks + kGroup - 1) / kGroup;
  const int64_t nseg = static_cast<int64_t>(coeffs.size());
  const int nt = n < kParallelMin ? 1 : team_size();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    alignas(64) float m[kBlock];
    alignas(64) float v[kBlock];
    int64_t s = 0;
    for (int64_t b = gi * kGroup; b < std::min(nblocks, (gi + 1) * kGroup); ++b) {
      const int64_t lo = b * kBlock;
      const int64_t len = std::min(kBlock, n - lo);
      while (s < nseg && bounds[2 * s + 1] <= lo) ++s;
      bool touched = false;  // a block no segment reaches keeps its bytes
      for (int64_t t = s; t < nseg && bounds[2 * t] < lo + len && !touched; ++t) {
        touched = std::max(lo, bounds[2 * t]) < std::min(lo + len, bounds[2 * t + 1]);
      }
      if (!touched) continue;
      q8_dequantize_block(qm.code, qm.q + lo, len, qm.absmax[b], m, vec);
      q8_dequantize_block(qv.code, qv.q + lo, len, qv.absmax[b], v, vec);
      for (int64_t t = s; t < nseg && bounds[2 * t] < lo + len; ++t) {
        const int64_t x0 = std::max(lo, bounds[2 * t]);
        const int64_t x1 = std::min(lo + len, bounds[2 * t + 1]);
        if (x0 >= x1) continue;
        adam_range<G, O>(p + x0, g + x0, m + (x0 - lo), v + (x0 - lo), out ? out + x0 : nullptr,
                         x1 - x0, coeffs[t], simd);
      }
      q8_quantize_block(qm.table, m, len, qm.absmax + b, qm.q + lo, vec);
      q8_quantize_block(qv.table, v, len, qv.absmax + b, qv.q + lo, vec);
    }
  }
}

template <typename G>
void adam8bit_dispatch(float* p, const G* g, uint16_t* out, Lowp lowp, int64_t n,
                       const Q8Side& qm, const Q8Side& qv, const std::vector<int64_t>& bounds,
                       const std::vector<Coeffs>& coeffs) {
  switch (lowp) {
    case Lowp::kBF16: return adam8bit_all<G, Lowp::kBF16>(p, g, out, n, qm, qv, bounds, coeffs);
    case Lowp::kF16: return adam8bit_all<G, Lowp::kF16>(p, g, out, n, qm, qv, bounds, coeffs);
    default: return adam8bit_all<G, Lowp::kNone>(p, g, nullptr, n, qm, qv, bounds, coeffs);
  }
}

// One Adam/AdamW step over a shard whose moments are 8-bit blockwise (codes and absmax of
// blocks of 256 counted from element 0): param[n], grad[n], q_m/q_v[n] uint8, absmax_m/
// absmax_v[ceil(n / 256)], code_m/code_v the 256-entry maps. Segment t covers elements
// [bounds[t][0], bounds[t][1]) with hyper[t] = (step, lr, beta1, beta2, eps, weight_decay,
// adamw, bias_correction); segments are in order and do not overlap.
void adam_update_8bit(at::Tensor param, at::Tensor grad, at::Tensor q_m, at::Tensor absmax_m,
                      const at::Tensor& code_m, at::Tensor q_v, at::Tensor absmax_v,
                      const at::Tensor& code_v, std::optional<at::Tensor> out,
                      const at::Tensor& bounds, const at::Tensor& hyper) {
  const int64_t n = param.numel();
  check_f32(param, "param", n);
  check_grad(grad, n);
  q8_check_moment(q_m, absmax_m, n, "q_m", "absmax_m (one per block of 256)");
  q8_check_moment(q_v, absmax_v, n, "q_v", "absmax_v (one per block of 256)");
  TORCH_CHECK(bounds.device().is_cpu() && bounds.scalar_type() == at::kLong &&
                  bounds.dim() == 2 && bounds.size(1) == 2,
              "bounds must be an int64 CPU tensor of shape (segments, 2)");
  const int64_t nseg = bounds.size(0);
  TORCH_CHECK(hyper.device().is_cpu() && hyper.scalar_type() == at::kDouble &&
                  hyper.dim() == 2 && hyper.size(0) == nseg && hyper.size(1) == 8,
              "hyper must be a float64 CPU tensor of shape (", nseg, ", 8)");
  const at::Tensor b = bounds.contiguous();
  const at::Tensor h = hyper.contiguous();
  std::vector<int64_t> bv(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + 2 * nseg);
  std::vector<Coeffs> coeffs;
  const double* hp = h.data_ptr<double>();
  for (int64_t t = 0; t < nseg; ++t, hp += 8) {
    TORCH_CHECK(bv[2 * t] >= (t ? bv[2 * t - 1] : 0) && bv[2 * t] <= bv[2 * t + 1] &&
                    bv[2 * t + 1] <= n,
                "segments must be in order, not overlap, and lie in [0, ", n, "]");
    TORCH_CHECK(hp[0] >= 1 && hp[0] <= 9007199254740992.0 && std::floor(hp[0]) == hp[0],
                "step must be an integer >= 1, got ", hp[0]);  // (NaN fails the first test)
    const int64_t step = static_cast<int64_t>(hp[0]);
    coeffs.push_back(make_coeffs(step, hp[1], hp[2], hp[3], hp[4], hp[5], hp[6] != 0.0,
                                 hp[7] != 0.0));  // stream_out stays false: small ranges
  }
  Lowp lowp;
  uint16_t* outp;
  std::tie(lowp, outp) = lowp_out(out, n);
  const void* table_m = q8_table(code_m);  // checks the code first
  const void* table_v = q8_table(code_v);
  const Q8Side qm{q_m.data_ptr<uint8_t>(), absmax_m.data_ptr<float>(),
                  code_m.data_ptr<float>(), table_m};
  const Q8Side qv{q_v.data_ptr<uint8_t>(), absmax_v.data_ptr<float>(),
                  code_v.data_ptr<float>(), table_v};
  if (n == 0) return;
  float* p = param.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  with_grad_data(grad, [&](const auto* g) {
    adam8bit_dispatch(p, g, outp, lowp, n, qm, qv, bv, coeffs);
  });
}

// ---------------------------------------------------------------------------------
// Memory-bandwidth probe with Adam's access pattern: 4 fp32 streams read, 3 written
// in place (p += g; m += g; v += g), same chunking, threads, vector width and prefetch as
// the update.

#ifdef ZT_X86
ZT_AVX2 inline void probe8(float* p, const float* g, float* m, float* v) {
  const __m256 gv = _mm256_loadu_ps(g);
  _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), gv));
  _mm256_storeu_ps(m, _mm256_add_ps(_mm256_loadu_ps(m), gv));
  _mm256_storeu_ps(v, _mm256_add_ps(_mm256_loadu_ps(v), gv));
}

ZT_AVX2 void probe_avx2(float* p, const float* g, float* m, float* v, int64_t n) {
  const int64_t ahead = g_prefetch;
  int64_t i = 0;
  for (; i + ahead + 16 <= n; i += 16) {  // prefetched as the update is
    if (ahead) prefetch_ahead(p + i, g + i, m + i, v + i, ahead);
    probe8(p + i, g + i, m + i, v + i);
    probe8(p + i + 8, g + i + 8, m + i + 8, v + i + 8);
  }
  for (; i + 8 <= n; i += 8) probe8(p + i, g + i, m + i, v + i);
  for (; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

ZT_AVX512 inline void probe16(float* p, const float* g, float* m, float* v) {
  const __m512 gv = _mm512_loadu_ps(g);
  _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), gv));
  _mm512_storeu_ps(m, _mm512_add_ps(_mm512_loadu_ps(m), gv));
  _mm512_storeu_ps(v, _mm512_add_ps(_mm512_loadu_ps(v), gv));
}

ZT_AVX512 void probe_avx512(float* p, const float* g, float* m, float* v, int64_t n) {
  const int64_t ahead = g_prefetch;
  int64_t i = 0;
  for (; i + ahead + 16 <= n; i += 16) {
    if (ahead) prefetch_ahead(p + i, g + i, m + i, v + i, ahead);
    probe16(p + i, g + i, m + i, v + i);
  }
  for (; i + 16 <= n; i += 16) probe16(p + i, g + i, m + i, v + i);
  probe_avx2(p + i, g + i, m + i, v + i, n - i);  // the last 15 at most
}
#endif

void stream_probe(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  const int64_t n = p.numel();
  check_f32(p, "p", n);
  check_f32(g, "g", n);
  check_f32(m, "m", n);
  check_f32(v, "v", n);
  float* pp = p.data_ptr<float>();
  const float* gp = g.const_data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const Simd simd = g_simd;
  pybind11::gil_scoped_release no_gil;
  for_each_chunk(n, [&](int64_t b, int64_t e) {
#ifdef ZT_X86
    if (simd == Simd::kAvx512) return probe_avx512(pp + b, gp + b, mp + b, vp + b, e - b);
    if (simd == Simd::kAvx2) return probe_avx2(pp + b, gp + b, mp + b, vp + b, e - b);
#endif
    for (int64_t i = b; i < e; ++i) {
      pp[i] += gp[i];
      mp[i] += gp[i];
      vp[i] += gp[i];
    }
  });
}

std::string simd_level() { return simd_name(g_simd); }

bool simd_vector() { return g_simd != Simd::kScalar; }

std::string set_simd_level(const std::string& level) {
  Simd want;
  if (level == "auto") {
    want = kDetected;
  } else if (level == "avx512") {
    want = Simd::kAvx512;
  } else if (level == "avx2") {
    want = Simd::kAvx2;
  } else if (level == "scalar") {
    want = Simd::kScalar;
  } else {
    TORCH_CHECK(false, "unknown SIMD level '", level, "' (auto, avx512, avx2, scalar)");
  }
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(kDetected), "this CPU does not support ",
              level, " (best: ", simd_name(kDetected), ")");
  g_simd = want;
  return simd_name(g_simd);
}

int64_t set_prefetch(int64_t elements) {
  if (elements == -1) {
    g_prefetch = kPrefetchDetected;
  } else {
    TORCH_CHECK(elements >= 0 && elements % 16 == 0 && elements <= (1 << 16),
                "prefetch distance must be a multiple of 16 elements, at most 65536, got ",
                elements);
    g_prefetch = elements;
  }
  return g_prefetch;
}

int64_t prefetch_distance() { return g_prefetch; }

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// csrc/adam/quant8.cpp
void quantize_blockwise(const at::Tensor& x, const at::Tensor& code, at::Tensor absmax,
                        at::Tensor q);
void dequantize_blockwise(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                          at::Tensor out);

}  // namespace zerotune_adam

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace za = zerotune_adam;
  m.doc() = "zerotune CPU Adam/AdamW (SIMD chosen at run time, OpenMP across cores)";
  m.def("adam_update", &za::adam_update, "In-place Adam/AdamW step over flat fp32 shards",
        pybind11::arg("param"), pybind11::arg("grad"), pybind11::arg("exp_avg"),
        pybind11::arg("exp_avg_sq"), pybind11::arg("out"), pybind11::arg("step"),
        pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"),
        pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("adamw"),
        pybind11::arg("bias_correction"));
  m.def("stream_probe", &za::stream_probe,
        "Bandwidth probe: p += g; m += g; v += g (Adam's 4-read/3-write pattern)");
  m.def("simd_level", &za::simd_level, "SIMD level in use: avx512, avx2 or scalar");
  m.def("set_simd_level", &za::set_simd_level,
        "Lower the SIMD level (auto, avx512, avx2, scalar); for tests and debugging");
  m.def("max_threads", &za::max_threads, "OpenMP max threads");
  m.def("prefetch_distance", &za::prefetch_distance,
        "Elements ahead of the loads the vector loops prefetch (0: none)");
  m.def("set_prefetch", &za::set_prefetch,
        "Set the prefetch distance in elements (0: none, -1: this CPU's default); for "
        "benchmarks and tests");
  m.def("adam_update_8bit", &za::adam_update_8bit,
        "Adam/AdamW step over 8-bit blockwise moments, one pass per block of 256",
        pybind11::arg("param"), pybind11::arg("grad"), pybind11::arg("q_m"),
        pybind11::arg("absmax_m"), pybind11::arg("code_m"), pybind11::arg("q_v"),
        pybind11::arg("absmax_v"), pybind11::arg("code_v"), pybind11::arg("out"),
        pybind11::arg("bounds"), pybind11::arg("hyper"));
  m.def("quantize_blockwise", &za::quantize_blockwise,
        "8-bit blockwise quantization to the nearest code (blocks of 256, fp32 absmax)",
        pybind11::arg("x"), pybind11::arg("code"), pybind11::arg("absmax"), pybind11::arg("q"));
  m.def("dequantize_blockwise", &za::dequantize_blockwise,
        "out = code[q] * absmax of the element's block of 256", pybind11::arg("q"),
        pybind11::arg("absmax"), pybind11::arg("code"), pybind11::arg("out"));
}
