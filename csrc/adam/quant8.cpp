// Blockwise 8-bit quantization of Adam moments on the CPU (see [Note: 8-bit optimizer
// states] in zerotune/optim/quant8.py for the format: blocks of 256 elements, one fp32
// absmax per block, codes indexing a sorted table of 256 values in [-1, 1]).
//
// [Note: nearest code by table]
// A value x of a block is stored as the code whose table entry is nearest to x / absmax:
// the index of the first of the 255 midpoints between neighbouring entries that is not
// below it (a value exactly on a midpoint takes the lower code). A binary search over the
// midpoints costs 8 dependent compares per element. Instead, the top 15 bits of the fp32
// value (sign, exponent, 6 mantissa bits) select one of 32768 buckets of the real line,
// and a table gives, per bucket, the number of midpoints below the bucket's smallest value:
// a lower bound of the answer, raised by scanning the midpoints upwards while they are below
// the value. The dynamic codes have at most a few entries per binary octave (bitsandbytes'
// maps: fewer than 64), so the scan is almost always zero or one step; it is exact for any
// sorted table, only slower for a denser one. The result is the exact nearest code, which
// bitsandbytes' own CPU search gives for all but ~0.15% of elements (it is approximate
// there); dequantizing is code[q] * absmax.

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace zerotune_adam {

namespace {

constexpr int64_t kBlock = 256;
constexpr int kShift = 17;  // 32 - 15 bits of key
constexpr int kBuckets = 1 << (32 - kShift);

struct CodeTable {
  std::array<float, 256> code{};
  std::array<float, 255> mid{};
  std::vector<uint8_t> start;  // per bucket: midpoints below the bucket's smallest value
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
  t.start.resize(kBuckets);
  for (uint32_t key = 0; key < static_cast<uint32_t>(kBuckets); ++key) {
    uint32_t lo = key << kShift;
    bool negative = (lo >> 31) != 0;
    // the smallest value of the bucket: the largest magnitude when negative
    float smallest = float_of(negative ? (lo | ((1u << kShift) - 1)) : lo);
    // NaN payloads start at 0 (the scan stops at once); at most 255 midpoints lie below
    t.start[key] = std::isnan(smallest)
                       ? 0
                       : static_cast<uint8_t>(
                             std::lower_bound(t.mid.begin(), t.mid.end(), smallest) -
                             t.mid.begin());
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

// x (fp32, n) -> q (uint8, n) and absmax (fp32, ceil(n / 256)).
void quantize_blockwise(const at::Tensor& x, const at::Tensor& code, at::Tensor absmax,
                        at::Tensor q) {
  check_code(code);
  const int64_t n = x.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check_flat(x, at::kFloat, n, "x");
  check_flat(q, at::kByte, n, "q");
  check_flat(absmax, at::kFloat, nblocks, "absmax (one per block of 256)");
  const CodeTable& t = table_for(code.data_ptr<float>());
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* ap = absmax.data_ptr<float>();
#pragma omp parallel for schedule(static) if (nblocks >= 256)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t hi = std::min(lo + kBlock, n);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = lo; i < hi; ++i) {
      const float a = std::fabs(xp[i]);
      finite = finite && std::isfinite(a);
      amax = std::max(amax, a);
    }
    if (amax == 0.0f || !finite) {
      // All zeros: the code nearest to 0. An inf or NaN makes the whole block NaN (absmax
      // NaN), so a diverged moment stays visible instead of turning into finite codes.
      ap[b] = finite ? 0.0f : NAN;
      const uint8_t z = nearest(t, 0.0f);
      for (int64_t i = lo; i < hi; ++i) qp[i] = z;
      continue;
    }
    ap[b] = amax;
    // A division, not a multiplication by 1 / amax: exact for every value, and an absmax
    // below ~3e-39 (a moment decayed for hundreds of steps) has no finite reciprocal.
    for (int64_t i = lo; i < hi; ++i) qp[i] = nearest(t, xp[i] / amax);
  }
}

// q (uint8, n), absmax (fp32, ceil(n / 256)) -> out (fp32, n) = code[q] * absmax.
void dequantize_blockwise(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                          at::Tensor out) {
  check_code(code);
  const int64_t n = q.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check_flat(q, at::kByte, n, "q");
  check_flat(absmax, at::kFloat, nblocks, "absmax (one per block of 256)");
  check_flat(out, at::kFloat, n, "out");
  const float* c = code.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (nblocks >= 256)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t hi = std::min(lo + kBlock, n);
    const float a = ap[b];
    for (int64_t i = lo; i < hi; ++i) op[i] = c[qp[i]] * a;
  }
}

}  // namespace zerotune_adam
