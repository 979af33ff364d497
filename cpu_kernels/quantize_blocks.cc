// Every (bm, bk) block of x (M, K) quantized to int8 or packed int4 with one f32 scale per block,
// as an XLA FFI custom call (see cpu_kernels/__init__.py): the CPU path of bsr_jax's sparsity-0
// storage (bsr_jax/quantize.py's quantize_blocks is the reference).
//
// Left to XLA:CPU, the same computation is a reduction for the scales and a loop fusion for the
// values, and XLA fuses x's producer into both: for fc2 of a ResMLP it recomputed the exact GELU
// (an erf polynomial) once per consumer, and the int4 pack alone took longer than the layer's
// matmul. Here x is read once from memory, a block at a time: scale, round, clamp and pack in
// registers, the blocks written in block-column-major order (block (i, j) at slot j * Mb + i).
//
// Per block, with limit L (127 or 7): amax = max |v| over the block (padding counts as zeros);
// scale = NaN if any value is NaN or inf, else 1 if amax == 0, else amax * (1 / L); stored value
// q = clamp(round_half_even(v * (1 / scale)), -L, L), 0 where that product is NaN (as XLA converts
// NaN to an integer; in a NaN-scale block, every value). The same arithmetic as quantize_blocks,
// so results agree bitwise, except that XLA:CPU's vectorised max reduction can drop a NaN on large
// arrays (then the reference gives a finite scale; the rule, kept here, says NaN).

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

#define BSR_INLINE [[gnu::always_inline]] inline

namespace ffi = xla::ffi;

// Bit (1 << isa) per instruction set this CPU and OS support (bsr_t_matmul.cc): the paths' target
// attributes must match what it checks (avx512f, avx2, fma), or a path could die on an illegal
// instruction instead of failing the call.
extern "C" int32_t BsrJaxCpuIsaMask();

namespace bsr_jax {
namespace {

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };  // as in bsr_t_matmul.cc

struct Job {
  const void* x;  // (M, K) f32 or bf16
  bool bf16;
  uint8_t* out;   // (Mb * Kb, bm, bk) int8, or (Mb * Kb, ceil(bm * bk / 2)) packed int4
  float* scales;  // (Mb * Kb,)
  int64_t m, k, bm, bk, mb, kb, limit;
};

// Round half to even for |v| < 2^22 under the default rounding mode (adding 1.5 * 2^23 leaves no
// fraction bits): vectorises on every path, where rintf needs SSE4.1.
template <class F>
BSR_INLINE F RoundHalfEven(F v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// Blocks are handled a vector register of floats at a time (GCC/clang generic vectors sized per
// path: 16-float vectors lowered to AVX2 or SSE2 took 3-4x longer); the buffers are padded to
// whole pairs of the widest vectors with zeros, which change neither max |v| nor the stored
// values. (Plain loops stayed scalar: a float max reduction is not vectorised without -ffast-math,
// and int8 stores may alias anything. That version took 3-8x the time of one XLA pass over x.)
template <int L>  // lanes: one vector register of floats (16 AVX-512, 8 AVX2, 4 portable)
struct Vectors {
  typedef float Floats __attribute__((vector_size(L * 4)));
  typedef int32_t Ints __attribute__((vector_size(L * 4)));
  typedef int8_t Bytes __attribute__((vector_size(L)));
  typedef uint16_t Pairs __attribute__((vector_size(L * 2)));
  typedef uint8_t Packed __attribute__((vector_size(L)));
};
constexpr int64_t kMaxLanes = 16;

BSR_INLINE int64_t Padded(int64_t size) { return (size + 2 * kMaxLanes - 1) / (2 * kMaxLanes) * (2 * kMaxLanes); }

// Unaligned vector access (see tile_kernel.h's Load for why not memcpy).
template <class V, class T>
BSR_INLINE V LoadVec(const T* p) {
  typedef V Unaligned __attribute__((aligned(alignof(T)), may_alias));
  return *reinterpret_cast<const Unaligned*>(p);
}

template <class V, class T>
BSR_INLINE void StoreVec(T* p, V v) {
  typedef V Unaligned __attribute__((aligned(alignof(T)), may_alias));
  *reinterpret_cast<Unaligned*>(p) = v;
}

// Block (i, j) of x into `block` (bm * bk floats, row-major, zeros past x's edges). Whole f32 rows
// of whole vectors are copied a vector at a time (a memcpy call per 64-byte row was a quarter of
// the time).
template <int L>
BSR_INLINE void LoadBlock(const Job& q, int64_t i, int64_t j, float* block) {
  using Floats = typename Vectors<L>::Floats;
  const int64_t rows = std::min(q.bm, q.m - i * q.bm), cols = std::min(q.bk, q.k - j * q.bk);
  for (int64_t r = 0; r < q.bm; ++r) {
    float* dst = block + r * q.bk;
    const int64_t valid = r < rows ? cols : 0;
    const int64_t offset = (i * q.bm + r) * q.k + j * q.bk;
    if (q.bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(q.x) + offset;
      for (int64_t c = 0; c < valid; ++c) {
        const uint32_t bits = static_cast<uint32_t>(src[c]) << 16;  // bf16 is f32's upper half
        std::memcpy(dst + c, &bits, sizeof bits);
      }
    } else if (valid == q.bk && q.bk % L == 0) {
      const float* src = static_cast<const float*>(q.x) + offset;
      for (int64_t c = 0; c < valid; c += L) StoreVec(dst + c, LoadVec<Floats>(src + c));
    } else {
      std::memcpy(dst, static_cast<const float*>(q.x) + offset, valid * sizeof(float));
    }
    std::fill(dst + valid, dst + q.bk, 0.0f);
  }
}

// The block's values as integers in [-limit, limit] (into `ints`), and its scale.
template <int L>
BSR_INLINE float QuantizeBlock(const Job& q, const float* block, int8_t* ints) {
  using Floats = typename Vectors<L>::Floats;
  using Ints = typename Vectors<L>::Ints;
  using Bytes = typename Vectors<L>::Bytes;
  const int64_t size = Padded(q.bm * q.bk);
  Floats amax = {};
  Ints finite = ~Ints{};
  for (int64_t e = 0; e < size; e += L) {
    const Floats a = (Floats)((Ints)LoadVec<Floats>(block + e) & 0x7fffffff);
    amax = amax < a ? a : amax;
    finite &= a <= FLT_MAX;  // false for NaN and inf
  }
  float block_max = 0.0f;
  bool nonfinite = false;
  for (int c = 0; c < L; ++c) {
    block_max = std::max(block_max, amax[c]);
    nonfinite |= !finite[c];
  }
  const float limit = static_cast<float>(q.limit);
  const float scale = nonfinite ? __builtin_nanf("") : block_max > 0.0f ? block_max * (1.0f / limit) : 1.0f;
  const float inverse = 1.0f / scale;
  for (int64_t e = 0; e < size; e += L) {
    Floats v = LoadVec<Floats>(block + e) * inverse;
    v = v < -limit ? -limit : v;  // comparisons with NaN are false: NaN stays NaN
    v = v > limit ? limit : v;
    // NaN (a NaN scale, or 0 * inf when amax / L underflows to 0) stores 0, as XLA converts it.
    const Floats rounded = v == v ? RoundHalfEven(v) : Floats{};
    StoreVec(ints + e, __builtin_convertvector(__builtin_convertvector(rounded, Ints), Bytes));
  }
  return scale;
}

template <int L>
BSR_INLINE void StoreBlock(const Job& q, int64_t slot, const int8_t* ints) {
  using Pairs = typename Vectors<L>::Pairs;
  const int64_t size = q.bm * q.bk;
  if (q.limit == 127) {
    std::memcpy(q.out + slot * size, ints, size);
    return;
  }
  // Two 4-bit two's-complement values per byte, low nibble first; an odd size pads a zero nibble.
  // A 16-bit lane holds one pair, the low nibble's value in its low byte (x86 is little-endian).
  uint8_t* dst = q.out + slot * ((size + 1) / 2);
  int64_t e = 0;
  for (; e + 2 * L <= size; e += 2 * L) {
    const Pairs pairs = LoadVec<Pairs>(ints + e);
    StoreVec(dst + e / 2, __builtin_convertvector((pairs & 0xF) | ((pairs >> 4) & 0xF0), typename Vectors<L>::Packed));
  }
  for (; e + 1 < size; e += 2) dst[e / 2] = (ints[e] & 0xF) | ((ints[e + 1] & 0xF) << 4);
  if (size % 2) dst[size / 2] = ints[size - 1] & 0xF;
}

// Block-row `i`, every block-column: x's bm rows are read once, left to right.
template <int L>
BSR_INLINE void RunBlockRow(const Job& q, int64_t i, float* block, int8_t* ints) {
  for (int64_t j = 0; j < q.kb; ++j) {
    LoadBlock<L>(q, i, j, block);
    const int64_t slot = j * q.mb + i;
    q.scales[slot] = QuantizeBlock<L>(q, block, ints);
    StoreBlock<L>(q, slot, ints);
  }
}

using RowFn = void (*)(const Job&, int64_t, float*, int8_t*);

void RunPortable(const Job& q, int64_t i, float* block, int8_t* ints) { RunBlockRow<4>(q, i, block, ints); }

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void RunAvx2(const Job& q, int64_t i, float* block, int8_t* ints) {
  RunBlockRow<8>(q, i, block, ints);
}
__attribute__((target("avx512f,avx2,fma"))) void RunAvx512(const Job& q, int64_t i, float* block, int8_t* ints) {
  RunBlockRow<16>(q, i, block, ints);
}
#endif

RowFn RowFor(int64_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == kAvx512) return RunAvx512;
  if (isa == kAvx2) return RunAvx2;
#endif
  return RunPortable;
}

ffi::Error Invalid(const std::string& message) { return ffi::Error::InvalidArgument("quantize_blocks: " + message); }

ffi::Error QuantizeBlocks(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                          ffi::ResultBuffer<ffi::F32> scales, int64_t bm, int64_t bk, int64_t bits, int64_t isa) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return Invalid("x must be (M, K)");
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16)
    return Invalid("x must be f32 or bf16");
  if (bm < 1 || bk < 1 || bm > dims[0] || bk > dims[1]) return Invalid("block sides must be in [1, x's sides]");
  if (bits != 4 && bits != 8) return Invalid("bits must be 4 or 8");
  if (isa < kPortable || isa > kAvx512 || !(BsrJaxCpuIsaMask() & (1 << isa)))
    return Invalid("isa " + std::to_string(isa) + " is not supported by this CPU");
  Job q{x.untyped_data(), x.element_type() == ffi::DataType::BF16, static_cast<uint8_t*>(out->untyped_data()),
        scales->typed_data(), dims[0], dims[1], bm, bk, (dims[0] + bm - 1) / bm, (dims[1] + bk - 1) / bk,
        bits == 8 ? 127 : 7};
  const int64_t slot_bytes = bits == 8 ? bm * bk : (bm * bk + 1) / 2;
  const int64_t want_type = bits == 8 ? static_cast<int64_t>(ffi::DataType::S8) : static_cast<int64_t>(ffi::DataType::U8);
  if (static_cast<int64_t>(out->element_type()) != want_type || out->size_bytes() != static_cast<size_t>(q.mb * q.kb * slot_bytes) ||
      scales->element_count() != static_cast<size_t>(q.mb * q.kb))
    return Invalid("results must be (Mb * Kb) blocks of int8 (bits 8) or packed int4 as uint8 (bits 4), and (Mb * Kb,) scales");
  const RowFn row = RowFor(isa);
  ShareOut(pool, q.mb, [q, row](const auto& next_item) {
    std::vector<float> block(Padded(q.bm * q.bk));  // the padding stays 0
    std::vector<int8_t> ints(Padded(q.bm * q.bk));
    for (int64_t i; (i = next_item()) >= 0;) row(q, i, block.data(), ints.data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace bsr_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeBlocks, bsr_jax::QuantizeBlocks,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bm")
                                  .Attr<int64_t>("bk")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("isa"));
