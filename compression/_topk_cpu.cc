// Exact top-k of |x| on CPU, as an XLA FFI handler: the native lane of
// adaptjax.compression's threshold selection (see _topk_native.py).
//
// 1. The r-th largest |x| of a stratified sample of 8192 entries gives a
//    threshold t that about (1 + 4.5/sqrt(expect))·k entries reach (expect:
//    the sample entries expected above the k-th largest).
// 2. One pass writes the positions of the entries with |x| >= t (branch-free
//    compaction: AVX-512 or AVX2 where the CPU has them, chosen at run time).
//    Fewer than k (a sample far off): again with every nonzero.
// 3. The k-th largest of the candidates: a histogram of [t, max] in at most
//    4096 buckets, then nth_element within the one bucket that holds it.
// 4. The k sent, in order of position: every candidate above the k-th
//    largest, then the ones equal to it, first ones first.
//
// The result is the exact top-k set of the nonzero entries with ties broken
// by position (the XLA lane's result whenever it is exact); unused slots,
// where fewer than k entries are nonzero, hold (size, 0). |x| is compared as
// bit patterns, so NaN ranks above inf, as in the XLA lane.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ADAPTJAX_X86 1
#include <immintrin.h>
#endif

namespace {

namespace ffi = xla::ffi;

constexpr int64_t kSample = 8192;
constexpr int64_t kChunk = 65536;  // entries scanned between checks of the room left
constexpr double kSigmas = 4.5;
constexpr int kBucketBits = 12;  // the candidates' histogram: at most 4096 buckets

uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Positions in [start, end) of the entries with magnitude bits >= t, in order.
// `pos` has room for end - start + 16: the vector lanes store whole vectors.
int64_t ScanScalar(const int32_t* raw, int64_t start, int64_t end, int32_t t, int32_t* pos) {
  int64_t c = 0;
  for (int64_t i = start; i < end; ++i) {
    pos[c] = static_cast<int32_t>(i);
    c += (raw[i] & 0x7fffffff) >= t;
  }
  return c;
}

#ifdef ADAPTJAX_X86
__attribute__((target("avx512f"))) int64_t ScanAvx512(const int32_t* raw, int64_t start,
                                                      int64_t end, int32_t t, int32_t* pos) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i below = _mm512_set1_epi32(t - 1);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i iota = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int32_t>(start)),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  int64_t c = 0, i = start;
  for (; i + 16 <= end; i += 16) {
    __m512i v = _mm512_and_si512(_mm512_loadu_si512(raw + i), abs_mask);
    __mmask16 m = _mm512_cmpgt_epi32_mask(v, below);
    // compress into a register, then a plain store: the compressing store to
    // memory is microcoded (slow) on some CPUs
    _mm512_storeu_si512(pos + c, _mm512_maskz_compress_epi32(m, iota));
    c += __builtin_popcount(m);
    iota = _mm512_add_epi32(iota, step);
  }
  return c + ScanScalar(raw, i, end, t, pos + c);
}

// For each 8-bit mask, the lanes to keep packed first: 3 bits per lane.
struct PackTable {
  uint32_t lanes[256];
  PackTable() {
    for (int m = 0; m < 256; ++m) {
      uint32_t packed = 0;
      int out = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (m >> lane & 1) packed |= static_cast<uint32_t>(lane) << (3 * out++);
      }
      lanes[m] = packed;
    }
  }
};
const PackTable kPack;

__attribute__((target("avx2"))) int64_t ScanAvx2(const int32_t* raw, int64_t start, int64_t end,
                                                 int32_t t, int32_t* pos) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i below = _mm256_set1_epi32(t - 1);
  const __m256i step = _mm256_set1_epi32(8);
  const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
  const __m256i seven = _mm256_set1_epi32(7);
  __m256i iota = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(start)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t c = 0, i = start;
  for (; i + 8 <= end; i += 8) {
    __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + i)),
                                 abs_mask);
    int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, below)));
    __m256i perm = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(kPack.lanes[m])), shifts), seven);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + c),
                        _mm256_permutevar8x32_epi32(iota, perm));
    c += __builtin_popcount(m);
    iota = _mm256_add_epi32(iota, step);
  }
  return c + ScanScalar(raw, i, end, t, pos + c);
}
#endif

using ScanFn = int64_t (*)(const int32_t*, int64_t, int64_t, int32_t, int32_t*);

// The scan lanes this CPU runs, fastest first ("scalar" everywhere).
struct Lane {
  const char* name;
  ScanFn scan;
};

std::vector<Lane> Lanes() {
  std::vector<Lane> lanes;
#ifdef ADAPTJAX_X86
  __builtin_cpu_init();  // runs from a static initializer, maybe before libgcc's
  if (__builtin_cpu_supports("avx512f")) lanes.push_back({"avx512", ScanAvx512});
  if (__builtin_cpu_supports("avx2")) lanes.push_back({"avx2", ScanAvx2});
#endif
  lanes.push_back({"scalar", ScanScalar});
  return lanes;
}

std::atomic<ScanFn> g_scan{Lanes().front().scan};  // tests switch lanes (use_scan_lane)

// Scratch reused across calls on the same thread: pages once touched stay. It
// keeps about 12 bytes per candidate of the largest call so far (1-3% of that
// leaf's size at ratios up to 1%), and is never shrunk: leaves of alternating
// sizes would otherwise pay for fresh pages on every step.
struct Scratch {
  std::unique_ptr<int32_t[]> pos;  // grown as candidates come, not sized for the leaf
  int64_t room = 0;
  std::vector<int32_t> bits, vals, bucket;
  std::vector<int64_t> hist;
};

// Positions of the entries with magnitude bits >= t, in order, into s.pos.
int64_t Scan(const int32_t* raw, int64_t n, int32_t t, Scratch& s) {
  const ScanFn scan = g_scan.load(std::memory_order_relaxed);
  int64_t c = 0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = std::min(n, start + kChunk);
    if (s.room < c + (end - start) + 16) {
      const int64_t room = std::max(2 * s.room, c + kChunk + 16);
      std::unique_ptr<int32_t[]> grown(new int32_t[room]);
      std::copy(s.pos.get(), s.pos.get() + c, grown.get());
      s.pos = std::move(grown);
      s.room = room;
    }
    c += scan(raw, start, end, t, s.pos.get() + c);
  }
  return c;
}

int32_t SampleThreshold(const int32_t* raw, int64_t n, int64_t k, Scratch& s) {
  int64_t size = std::min(n, kSample);
  const int64_t stride = n / size;
  size = n / stride;
  const double expect = static_cast<double>(k) * size / n;
  const int64_t r = static_cast<int64_t>(
      std::ceil(expect * (1 + kSigmas / std::sqrt(std::max(expect, 1e-9)))));
  if (r >= size) return 1;
  s.bits.resize(size);
  for (int64_t i = 0; i < size; ++i) {
    // a multiply and a shift, not a division: the sample's loads are the cost
    const int64_t at = i * stride + ((uint64_t{Mix(static_cast<uint32_t>(i))} * stride) >> 32);
    s.bits[i] = raw[at] & 0x7fffffff;
  }
  std::nth_element(s.bits.begin(), s.bits.begin() + (r - 1), s.bits.end(), std::greater<>());
  return std::max<int32_t>(s.bits[r - 1], 1);  // zeros are never sent
}

void TopK(const int32_t* raw, int64_t n, int64_t k, int32_t* out_idx, float* out_val) {
  thread_local Scratch s;
  const float* f = reinterpret_cast<const float*>(raw);
  int32_t t = SampleThreshold(raw, n, k, s);
  int64_t c = Scan(raw, n, t, s);
  if (c < k && t > 1) c = Scan(raw, n, t = 1, s);
  const int32_t* pos = s.pos.get();
  int64_t out = 0;
  if (c <= k) {
    for (; out < c; ++out) {
      out_idx[out] = pos[out];
      out_val[out] = f[pos[out]];
    }
  } else {
    s.bits.resize(c);
    s.vals.resize(c);
    int32_t* bits = s.bits.data();
    int32_t* vals = s.vals.data();  // the candidates' float32 patterns, sign and all
    int32_t top = t;
    for (int64_t i = 0; i < c; ++i) {
      vals[i] = raw[pos[i]];
      bits[i] = vals[i] & 0x7fffffff;
      top = std::max(top, bits[i]);
    }
    // buckets of [t, top]: the fewest bits that leave at most 2**kBucketBits
    int shift = 0;
    while (((static_cast<int64_t>(top) - t) >> shift) >= (int64_t{1} << kBucketBits)) ++shift;
    s.hist.assign(((static_cast<int64_t>(top) - t) >> shift) + 1, 0);
    for (int64_t i = 0; i < c; ++i) ++s.hist[(bits[i] - t) >> shift];
    int64_t above = 0;  // candidates in buckets above the k-th largest's
    int64_t b = static_cast<int64_t>(s.hist.size()) - 1;
    while (above + s.hist[b] < k) above += s.hist[b--];
    const int64_t m_end = s.hist[b];
    s.bucket.resize(m_end + 1);  // the branch-free loop stores one past the last
    int64_t m = 0;
    for (int64_t i = 0; i < c; ++i) {
      s.bucket[m] = bits[i];
      m += ((bits[i] - t) >> shift) == b;
    }
    const int64_t rank = k - above;  // of the k-th largest within its bucket, from 1
    std::nth_element(s.bucket.begin(), s.bucket.begin() + (rank - 1), s.bucket.begin() + m_end,
                     std::greater<>());
    const int32_t kth = s.bucket[rank - 1];
    int64_t ties = rank;  // entries equal to kth that are sent
    for (int64_t i = 0; i < rank - 1; ++i) ties -= s.bucket[i] > kth;
    // branch-free: a candidate is stored at `out` and kept by moving past it;
    // the loop ends at the k-th kept, so nothing is stored past the k slots
    int32_t* val_bits = reinterpret_cast<int32_t*>(out_val);
    for (int64_t i = 0; i < c; ++i) {
      const int64_t equal = bits[i] == kth;
      const int64_t take = (bits[i] > kth) | (equal & (ties > 0));
      ties -= equal & take;
      out_idx[out] = pos[i];
      val_bits[out] = vals[i];
      out += take;
      if (out == k) break;
    }
  }
  for (; out < k; ++out) {
    out_idx[out] = static_cast<int32_t>(n);
    out_val[out] = 0.0f;
  }
}

ffi::Error TopKImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> idx,
                    ffi::ResultBuffer<ffi::F32> val) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t k = static_cast<int64_t>(idx->element_count());
  if (x.dimensions().size() != 1 || idx->dimensions().size() != 1 ||
      static_cast<int64_t>(val->element_count()) != k) {
    return ffi::Error::InvalidArgument("adaptjax_topk_f32: expects f32[n] -> (s32[k], f32[k])");
  }
  if (k < 1 || k > n || n > INT32_MAX) {
    return ffi::Error::InvalidArgument("adaptjax_topk_f32: needs 1 <= k <= n < 2**31");
  }
  try {  // an exception must not cross the C boundary of the handler
    TopK(reinterpret_cast<const int32_t*>(x.typed_data()), n, k, idx->typed_data(),
         val->typed_data());
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "adaptjax_topk_f32: out of memory for the candidates' scratch");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdaptjaxTopKF32, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The Python module: `handler()` returns the FFI handler as a PyCapsule, which
// jax.ffi.register_ffi_target takes.
namespace {

PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&AdaptjaxTopKF32), nullptr, nullptr);
}

PyObject* ScanLanes(PyObject*, PyObject*) {
  std::vector<Lane> lanes = Lanes();
  PyObject* names = PyList_New(static_cast<Py_ssize_t>(lanes.size()));
  for (size_t i = 0; names != nullptr && i < lanes.size(); ++i) {
    PyObject* name = PyUnicode_FromString(lanes[i].name);
    if (name == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyList_SetItem(names, static_cast<Py_ssize_t>(i), name);  // steals the reference
  }
  return names;
}

PyObject* UseScanLane(PyObject*, PyObject* name) {
  const char* want = PyUnicode_AsUTF8AndSize(name, nullptr);
  if (want == nullptr) return nullptr;
  for (const Lane& lane : Lanes()) {
    if (std::string(lane.name) == want) {
      g_scan.store(lane.scan);
      Py_RETURN_NONE;
    }
  }
  PyErr_Format(PyExc_ValueError, "no scan lane %R on this CPU", name);
  return nullptr;
}

PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of adaptjax_topk_f32, a PyCapsule."},
    {"scan_lanes", ScanLanes, METH_NOARGS, "The scan lanes this CPU runs, the default first."},
    {"use_scan_lane", UseScanLane, METH_O, "Scan with the named lane (for tests)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_topk_cpu", "Exact top-k of |x| on CPU as an XLA FFI handler.", -1,
    kMethods,              nullptr,     nullptr,                                             nullptr,
    nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__topk_cpu() { return PyModule_Create(&kModule); }
