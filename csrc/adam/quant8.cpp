// Blockwise 8-bit quantization of Adam moments on the CPU (see [Note: 8-bit optimizer
// states] in zerotune/optim/quant8.py for the format: blocks of 256 elements, one fp32
// absmax per block, codes indexing a sorted table of 256 values in [-1, 1]).
//
// [Note: nearest code by table]
// A value x of a block is stored as the code whose table entry is nearest to x / absmax:
// the index of the first of the 255 midpoints between neighbouring entries that is not
// below it (a value exactly on a midpoint takes the lower code). A binary search over the
// midpoints costs 8 dependent compares per element. Instead, the top 16 bits of the fp32
// value (sign, exponent, 7 mantissa bits) select one of 65536 buckets of the real line,
// and a table gives, per bucket, the number of midpoints below the bucket's smallest value:
// a lower bound of the answer, raised by scanning the midpoints upwards while they are below
// the value. The dynamic codes have at most a few entries per binary octave (bitsandbytes'
// maps: fewer than 128, and no bucket holds two midpoints), so the scan is zero or one
// step; it is exact for any sorted table, only slower for a denser one. The result is the
// exact nearest code (but see [Note: no positive value becomes zero]), which
// bitsandbytes' own CPU search gives for all but ~0.15% of elements (it is approximate
// there); dequantizing is code[q] * absmax.
//
// [Note: no positive value becomes zero]
// A table of non-negative codes starting at 0 (the unsigned map of exp_avg_sq) gives every
// positive value at least code 1: its first midpoint is 0. Nearest rounding would store an
// exp_avg_sq below half of code[1] * absmax (3.25e-7 of the block's largest) as 0, while
// exp_avg, on its finer signed map, keeps the same element's momentum; a later step
// without gradient there (a token absent from the batch: untied embedding rows) then
// divides that momentum by sqrt(0) + eps, and the weight jumps by thousands of lr (1.3 on
// a tiny Llama's embedding, against 0.004 for bitsandbytes' AdamW8bit, whose CPU search
// rounds such values several codes up). With the floor, an exp_avg_sq raised to code 1 is
// at least its true value, so the step stays within Adam's usual size.
//
// [Note: quantizer SIMD]
// With AVX2 eight values go through the same steps at once: one division, the bucket
// index by a shift, one table load per lane, one integer compare. The first step
// (mid[start] < y) needs no float threshold: within a bucket the values share their top 16
// bits, so their order is that of their low 16 bits (reversed for negative values), and the
// step holds exactly for the values whose such rank is above some t of the bucket. One
// 32-bit entry per bucket holds start | t << 8 (`pack_bucket`, which finds t by bisecting
// the bucket with the scalar compare, so the two paths cannot disagree). One lookup in a
// 256 KiB table instead of two independent ones (start, and mid[start]) from 320 KiB,
// which measured faster (a dependent lookup of mid[start] was slower still). The lookup is
// eight scalar loads assembled into a vector, not a vpgatherdd: on AMD EPYC (Zen 3) the
// gather made the fused 8-bit update slower; a table cut down to fit L1 (exponents clamped
// to the range that matters) gained nothing either.
// When no bucket holds more than one midpoint (`one_step`, true for the dynamic maps) that
// is the whole answer; otherwise a gather checks whether the scan would go on, and if it
// would in any lane the eight values take the scalar path. The absmax pass is vectorized
// too, and so is dequantizing (eight scalar loads of code[q], one multiplication by the
// absmax; a gather of code[q] was slower than plain scalar code).
// Every step is the same IEEE operation as the scalar code's, so both give the same bytes
// (tests compare them); `set_simd_level("scalar")` selects the scalar path.

// The headers it uses, not torch/extension.h: that one parses all of libtorch's C++ API,
// most of what building the op costs.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ZT_Q8_X86 1
#define ZT_Q8_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace zerotune_adam {

bool simd_vector();  // csrc/adam/cpu_adam.cpp: an AVX2 (or better) level is selected

namespace {

constexpr int64_t kBlock = 256;
constexpr int kShift = 16;  // 32 - 16 bits of key
constexpr int kBuckets = 1 << (32 - kShift);

struct CodeTable {
  std::array<float, 256> code{};
  std::array<float, 255> mid{};
  std::vector<uint8_t> start;  // per bucket: midpoints below the bucket's smallest value
  std::vector<int32_t> packed;  // per bucket, for the SIMD step: see [Note: quantizer SIMD]
  bool one_step = false;       // no bucket holds more than one midpoint
};

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// The bucket's values in increasing order have the ranks j = 0..65535 given by
// `bucket_rank`: their low 16 bits, reversed for negative values (a larger magnitude is a
// smaller value). The first step (mid[start] < y) holds for the ranks above some t, so the
// SIMD step needs only t and start: (start | t << 8), t = 0xffff when no value steps.
inline uint32_t bucket_rank(uint32_t bits) {
  return (bits & 0xffff) ^ ((bits >> 31) != 0 ? 0xffffu : 0u);
}

int32_t pack_bucket(const CodeTable& t, uint32_t key) {
  const int start = t.start[key];
  const auto steps = [&](uint32_t rank) {  // mid[start] < the bucket's value of that rank
    const float y = float_of((key << kShift) | bucket_rank((key << kShift) | rank));
    return start < 255 && t.mid[start] < y;
  };
  uint32_t lo = 0, hi = 0x10000;  // the first rank that steps, in [lo, hi]
  while (lo < hi) {
    const uint32_t m = (lo + hi) / 2;
    if (steps(m)) hi = m; else lo = m + 1;
  }
  // lo >= 1: the bucket's smallest value never steps (start counts the midpoints below it)
  return static_cast<int32_t>(start | (lo - 1) << 8);  // t = lo - 1, 0xffff: none steps
}

CodeTable make_table(const float* code) {
  CodeTable t;
  std::copy(code, code + 256, t.code.begin());
  for (int i = 0; i < 255; ++i) {
    // The largest float not above the exact midpoint: then "mid < y" holds exactly for the
    // floats y above the midpoint (fp32 (a + b) / 2 can round up past it).
    const double exact = (static_cast<double>(t.code[i]) + t.code[i + 1]) / 2;
    float m = static_cast<float>(exact);
    if (static_cast<double>(m) > exact) m = std::nextafter(m, -INFINITY);
    t.mid[i] = m;
  }
  // See [Note: no positive value becomes zero].
  if (t.code[0] == 0.0f && t.code[1] > 0.0f) t.mid[0] = 0.0f;
  t.start.assign(kBuckets, 0);
  t.packed.assign(kBuckets, 0xffff << 8);  // NaN buckets: code 0, no step
  t.one_step = true;
  const auto below = [&t](float x) {  // midpoints below x
    return static_cast<int>(std::lower_bound(t.mid.begin(), t.mid.end(), x) - t.mid.begin());
  };
  for (uint32_t key = 0; key < static_cast<uint32_t>(kBuckets); ++key) {
    uint32_t lo = key << kShift;
    uint32_t hi = lo | ((1u << kShift) - 1);
    bool negative = (lo >> 31) != 0;
    // the smallest value of the bucket: the largest magnitude when negative
    float smallest = float_of(negative ? hi : lo);
    float largest = float_of(negative ? lo : hi);
    // NaN payloads start at 0 (the scan stops at once); at most 255 midpoints lie below
    if (std::isnan(smallest) || std::isnan(largest)) continue;
    t.start[key] = static_cast<uint8_t>(below(smallest));
    t.packed[key] = pack_bucket(t, key);
    // Values of the bucket take start + (midpoints in [smallest, value)) as their code.
    if (below(largest) - t.start[key] > 1) t.one_step = false;
  }
  return t;
}

// The table of `code`, made once per distinct code (the two dynamic maps in practice).
const CodeTable& table_for(const float* code) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<CodeTable>> tables;
  std::lock_guard<std::mutex> lk(mu);
  for (const auto& t : tables) {
    if (std::memcmp(t->code.data(), code, sizeof(float) * 256) == 0) return *t;
  }
  tables.push_back(std::make_unique<CodeTable>(make_table(code)));
  return *tables.back();
}

inline uint8_t nearest(const CodeTable& t, float y) {
  int i = t.start[bits_of(y) >> kShift];
  // One branch-free step covers nearly every value (at most one midpoint per bucket for
  // the dynamic maps); the loop finishes the rare rest and any denser table.
  i += (i < 255 && t.mid[std::min(i, 254)] < y) ? 1 : 0;
  while (i < 255 && t.mid[i] < y) ++i;
  return static_cast<uint8_t>(i);
}

// The block's absmax, or NaN when it holds an inf or NaN (the caller stores it as is).
inline float block_absmax(const float* x, int64_t len) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && std::isfinite(a);
    amax = std::max(amax, a);
  }
  return finite ? amax : NAN;
}

inline void quantize_scalar(const CodeTable& t, const float* x, int64_t len, float amax,
                            uint8_t* q) {
  for (int64_t i = 0; i < len; ++i) q[i] = nearest(t, x[i] / amax);
}

#ifdef ZT_Q8_X86
ZT_Q8_AVX2 float block_absmax_avx2(const float* x, int64_t len) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 largest = _mm256_set1_ps(3.40282347e+38f);
  __m256 amax = _mm256_setzero_ps();
  __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, largest, _CMP_LE_OQ));  // false: inf, NaN
    amax = _mm256_max_ps(amax, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  const bool all_finite = _mm256_movemask_ps(finite) == 0xff;
  float tail = block_absmax(x + i, len - i);
  if (!all_finite || std::isnan(tail)) return NAN;
  float m = tail;
  for (float v : lanes) m = std::max(m, v);
  return m;
}

ZT_Q8_AVX2 void quantize_avx2(const CodeTable& t, const float* x, int64_t len, float amax,
                              uint8_t* q) {
  const __m256 div = _mm256_set1_ps(amax);
  const __m256i last = _mm256_set1_epi32(254);
  const __m256i top = _mm256_set1_epi32(255);
  const __m256i byte = _mm256_set1_epi32(0xff);
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  const int* packed = t.packed.data();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), div);
    const __m256i bits = _mm256_castps_si256(y);
    alignas(32) uint32_t key[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(key), _mm256_srli_epi32(bits, kShift));
    const __m256i e = _mm256_setr_epi32(packed[key[0]], packed[key[1]], packed[key[2]],
                                        packed[key[3]], packed[key[4]], packed[key[5]],
                                        packed[key[6]], packed[key[7]]);
    // code = start + (rank > t), the rank being the low 16 bits, reversed when negative
    const __m256i rank = _mm256_xor_si256(_mm256_and_si256(bits, low16),
                                          _mm256_and_si256(_mm256_srai_epi32(bits, 31), low16));
    __m256i code = _mm256_and_si256(e, byte);
    code = _mm256_sub_epi32(code, _mm256_cmpgt_epi32(rank, _mm256_srli_epi32(e, 8)));
    if (!t.one_step) {
      const __m256 m = _mm256_i32gather_ps(t.mid.data(), _mm256_min_epi32(code, last), 4);
      const __m256i up = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(m, y, _CMP_LT_OQ)),
                                          _mm256_cmpgt_epi32(top, code));
      if (!_mm256_testz_si256(up, up)) {  // the scan goes on in some lane
        quantize_scalar(t, x + i, 8, amax, q + i);
        continue;
      }
    }
    // eight 32-bit codes (each <= 255) -> eight bytes
    const __m256i w = _mm256_packus_epi32(code, code);  // per 128-bit lane: c0..3 c0..3
    const __m256i b = _mm256_packus_epi16(w, w);
    const uint64_t lo = static_cast<uint32_t>(_mm256_extract_epi32(b, 0));
    const uint64_t hi = static_cast<uint32_t>(_mm256_extract_epi32(b, 4));
    const uint64_t packed = lo | (hi << 32);
    std::memcpy(q + i, &packed, sizeof packed);
  }
  quantize_scalar(t, x + i, len - i, amax, q + i);
}

// The elements [0, returned) of `q8_dequantize_block`, eight at a time: eight scalar loads
// from the code (a gather was slower here) and the same multiplication as the scalar loop.
ZT_Q8_AVX2 int64_t dequantize_avx2(const float* code, const uint8_t* q, int64_t len,
                                   float absmax, float* out) {
  const __m256 scale = _mm256_set1_ps(absmax);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t k;
    std::memcpy(&k, q + i, sizeof k);
    const __m256 c = _mm256_setr_ps(code[k & 0xff], code[(k >> 8) & 0xff], code[(k >> 16) & 0xff],
                                    code[(k >> 24) & 0xff], code[(k >> 32) & 0xff],
                                    code[(k >> 40) & 0xff], code[(k >> 48) & 0xff], code[k >> 56]);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(c, scale));
  }
  return i;
}

#endif  // ZT_Q8_X86

void check_code(const at::Tensor& code) {
  TORCH_CHECK(code.device().is_cpu() && code.scalar_type() == at::kFloat && code.numel() == 256 &&
                  code.is_contiguous(),
              "quant8: code must be 256 contiguous fp32 values on the CPU");
  const float* c = code.data_ptr<float>();
  for (int i = 0; i < 255; ++i) {
    TORCH_CHECK(c[i] <= c[i + 1], "quant8: code must be sorted ascending");
  }
}

// Every tensor the kernels touch: on the CPU, of `type`, contiguous, `numel` elements.
void check_flat(const at::Tensor& t, at::ScalarType type, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() &&
                  t.numel() == numel,
              "quant8: ", what, " must be a contiguous CPU tensor of ", c10::toString(type),
              " with ", numel, " elements");
}

}  // namespace

// One moment of n elements: its codes (uint8, n) and absmax values (one per block).
void q8_check_moment(const at::Tensor& q, const at::Tensor& absmax, int64_t n,
                     const char* q_name, const char* absmax_name) {
  check_flat(q, at::kByte, n, q_name);
  check_flat(absmax, at::kFloat, (n + kBlock - 1) / kBlock, absmax_name);
}

// code[q] * absmax for the `len` elements of one block.
void q8_dequantize_block(const float* code, const uint8_t* q, int64_t len, float absmax,
                         float* out, bool vec) {
  int64_t i = 0;
#ifdef ZT_Q8_X86
  if (vec) i = dequantize_avx2(code, q, len, absmax, out);
#endif
  for (; i < len; ++i) out[i] = code[q[i]] * absmax;
}

const void* q8_table(const at::Tensor& code) {
  check_code(code);
  return &table_for(code.data_ptr<float>());
}

void q8_quantize_block(const void* table, const float* x, int64_t len, float* absmax,
                       uint8_t* q, bool vec) {
  const CodeTable& t = *static_cast<const CodeTable*>(table);
#ifdef ZT_Q8_X86
  const float amax = vec ? block_absmax_avx2(x, len) : block_absmax(x, len);
#else
  const float amax = block_absmax(x, len);
#endif
  *absmax = amax;
  if (amax == 0.0f || std::isnan(amax)) {
    // All zeros: the code nearest to 0. An inf or NaN makes the whole block NaN (absmax
    // NaN), so a diverged moment stays visible instead of turning into finite codes.
    std::memset(q, nearest(t, 0.0f), len);
    return;
  }
  // A division, not a multiplication by 1 / amax: exact for every value, and an absmax
  // below ~3e-39 (a moment decayed for hundreds of steps) has no finite reciprocal.
#ifdef ZT_Q8_X86
  if (vec) return quantize_avx2(t, x, len, amax, q);
#endif
  quantize_scalar(t, x, len, amax, q);
}

// x (fp32, n) -> q (uint8, n) and absmax (fp32, ceil(n / 256)).
void quantize_blockwise(const at::Tensor& x, const at::Tensor& code, at::Tensor absmax,
                        at::Tensor q) {
  const void* t = q8_table(code);
  const int64_t n = x.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check_flat(x, at::kFloat, n, "x");
  q8_check_moment(q, absmax, n, "q", "absmax (one per block of 256)");
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* ap = absmax.data_ptr<float>();
  const bool vec = simd_vector();
  pybind11::gil_scoped_release no_gil;
#pragma omp parallel for schedule(static) if (nblocks >= 256)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock;
    q8_quantize_block(t, xp + lo, std::min(lo + kBlock, n) - lo, ap + b, qp + lo, vec);
  }
}

// q (uint8, n), absmax (fp32, ceil(n / 256)) -> out (fp32, n) = code[q] * absmax.
void dequantize_blockwise(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                          at::Tensor out) {
  check_code(code);
  const int64_t n = q.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  q8_check_moment(q, absmax, n, "q", "absmax (one per block of 256)");
  check_flat(out, at::kFloat, n, "out");
  const float* c = code.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool vec = simd_vector();
  pybind11::gil_scoped_release no_gil;
#pragma omp parallel for schedule(static) if (nblocks >= 256)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock;
    q8_dequantize_block(c, qp + lo, std::min(lo + kBlock, n) - lo, ap[b], op + lo, vec);
  }
}

}  // namespace zerotune_adam
