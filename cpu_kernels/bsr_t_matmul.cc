// x.T @ dy on the CPU for a block-sparse x, as an XLA FFI custom call (see cpu_kernels/__init__.py).
//
// XLA has no way to say "multiply only these blocks" without materialising a gather of dy, and
// the gather (one (bm, N) slab per kept block, 7x the size of dy at block 16) costs as much as the
// dense matmul it replaces. This kernel reads dy in place instead:
//
// * The result's N columns are cut into tiles; a tile of dW, (Kb * bk, Tile) f32, stays in L2
//   while every kept block is applied to it. Tiles (split by block-columns when there are too few
//   to keep every thread busy) are shared out between threads of XLA's intra-op pool, each part of
//   dW with exactly one writer (no atomics, deterministic).
// * Inside a tile, blocks are visited a panel of block-rows at a time (a counting sort of the
//   column-major layout), so the slab of dy a panel multiplies is loaded once from memory and
//   reused from L1 by every kept block in it (tile_kernel.h).
// * Kept values may be stored as f32, bf16, int8 or packed int4 with per-block scales; they are
//   decoded a block at a time inside the kernel, so no f32 copy of x is ever made.
// * The register blocking is sized per instruction set and the set is chosen per call (an
//   attribute the Python side resolves from the CPU's features or BSR_JAX_CPU_ISA): one wheel
//   runs on any x86-64.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tile_kernel.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace bsr_jax {
namespace {

// Instruction sets, as the `isa` attribute numbers them; BsrJaxCpuIsaMask() sets bit 1 << isa.
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

typedef float Vec4 __attribute__((vector_size(16)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec16 __attribute__((vector_size(64)));

// Register budgets (accumulators + dy vectors + one broadcast): AVX2, and baseline x86-64 with
// 128-bit vectors, have 16 registers: 4 x 3 + 3 + 1 = 16 (the 4 x 4 grid of 16-float vectors that
// AVX-512 uses would take 32 AVX2 registers and spill: issue 23's 4.8-8x of dense). AVX-512 has
// 32: 4 x 4 + 4 + 1 = 21. Measured single-threaded on Zen 4 at s0.7/16 (fc1 and fc2 shapes), AVX2
// 4 x 3 ran at 80-85 GFLOP/s against 44-45 for 4 x 4, 61-85 for 4 x 2 and 66-68 for 6 x 2.
using PortableBlocking = Blocking<Vec4, 4, 3, 96>;
using Avx2Blocking = Blocking<Vec8, 4, 3, 96>;
using Avx512Blocking = Blocking<Vec16, 4, 4, 64>;

using TileFn = void (*)(const Problem&, int64_t, const Workspace&);

void RunItemPortable(const Problem& p, int64_t item, const Workspace& w) { RunItem<PortableBlocking>(p, item, w); }

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void RunItemAvx2(const Problem& p, int64_t item, const Workspace& w) {
  RunItem<Avx2Blocking>(p, item, w);
}
__attribute__((target("avx512f,avx2,fma"))) void RunItemAvx512(const Problem& p, int64_t item, const Workspace& w) {
  RunItem<Avx512Blocking>(p, item, w);
}
#endif

int32_t IsaMask() {
  int32_t mask = 1 << kPortable;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // also checks that the OS saves the wide registers
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) mask |= 1 << kAvx2;
  if ((mask & (1 << kAvx2)) && __builtin_cpu_supports("avx512f")) mask |= 1 << kAvx512;
#endif
  return mask;
}

struct Path {
  TileFn run;
  int64_t tile;
};

Path PathFor(int64_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == kAvx512) return {RunItemAvx512, Avx512Blocking::Tile};
  if (isa == kAvx2) return {RunItemAvx2, Avx2Blocking::Tile};
#endif
  return {RunItemPortable, PortableBlocking::Tile};
}

// One thread's share of the work items, with its own buffers (see work_queue.h).
void Drain(const Problem& p, Path path, const std::function<int64_t()>& next_item) {
  std::vector<float> values(p.panel * p.bm * p.bk), panel(p.panel * p.bm * path.tile), tile(p.kb * p.bk * path.tile);
  const Workspace w{values.data(), panel.data(), tile.data()};
  for (int64_t t; (t = next_item()) >= 0;) path.run(p, t, w);
}

ffi::Error Invalid(const std::string& message) { return ffi::Error::InvalidArgument("bsr_t_matmul: " + message); }

// Which storage `values` holds, after checking its shape against (cap, bm, bk) and `scales`.
ffi::Error CheckValues(const ffi::AnyBuffer& values, const ffi::Buffer<ffi::F32>& scales, int64_t bm, int64_t bk,
                       Stored* stored) {
  const auto dims = values.dimensions();
  switch (values.element_type()) {
    case ffi::DataType::F32: *stored = Stored::kF32; break;
    case ffi::DataType::BF16: *stored = Stored::kBF16; break;
    case ffi::DataType::S8: *stored = Stored::kInt8; break;
    case ffi::DataType::U8: *stored = Stored::kInt4; break;
    default: return Invalid("values must be f32, bf16, int8 or packed int4 (uint8)");
  }
  if (bm < 1 || bk < 1) return Invalid("block sides must be positive");
  const bool packed = *stored == Stored::kInt4;
  if (packed ? dims.size() != 2 || dims[1] != (bm * bk + 1) / 2 : dims.size() != 3 || dims[1] != bm || dims[2] != bk)
    return Invalid(packed ? "packed int4 values must be (cap, ceil(bm * bk / 2))" : "values must be (cap, bm, bk)");
  const bool scaled = *stored == Stored::kInt8 || packed;
  if (scaled && scales.element_count() != static_cast<size_t>(dims[0]))
    return Invalid("int8 / int4 values need (cap,) scales");
  return ffi::Error::Success();
}

ffi::Error BsrTMatmul(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::Buffer<ffi::F32> scales,
                      ffi::Buffer<ffi::S32> row_ids, ffi::Buffer<ffi::S32> col_ptr, ffi::Buffer<ffi::F32> dy,
                      ffi::ResultBuffer<ffi::F32> out, int64_t bm, int64_t bk, int64_t isa) {
  Problem p{};
  if (ffi::Error error = CheckValues(values, scales, bm, bk, &p.stored); error.failure()) return error;
  if (isa < kPortable || isa > kAvx512 || !(IsaMask() & (1 << isa)))
    return Invalid("isa " + std::to_string(isa) + " is not supported by this CPU");
  const auto ddims = dy.dimensions();
  const auto odims = out->dimensions();
  const int64_t cap = values.dimensions()[0];
  if (ddims.size() != 2 || col_ptr.element_count() < 1 || ddims[0] % bm != 0 || odims.size() != 2 ||
      odims[0] != static_cast<int64_t>(col_ptr.element_count() - 1) * bk || odims[1] != ddims[1] ||
      row_ids.element_count() != static_cast<size_t>(cap))
    return Invalid("want row_ids (cap,), col_ptr (Kb + 1,), dy (Mb * bm, N) and a (Kb * bk, N) result");
  p.cap = cap;
  p.bm = bm;
  p.bk = bk;
  p.kb = static_cast<int64_t>(col_ptr.element_count()) - 1;
  p.n = ddims[1];

  // Block-column of every block from col_ptr, then a stable counting sort by panel of block-rows.
  const int32_t* ptr = col_ptr.typed_data();
  const int32_t* rows = row_ids.typed_data();
  if (ptr[0] != 0 || ptr[p.kb] > p.cap) return Invalid("col_ptr must start at 0 and end at most at capacity");
  p.cap = ptr[p.kb];  // slots after the last column's are unused
  p.mb = ddims[0] / p.bm;
  p.panel = std::max<int64_t>(1, kPanelRows / p.bm);
  p.panels = (p.mb + p.panel - 1) / p.panel;
  std::vector<int32_t> cols(p.cap), order(p.cap), panel_start(p.panels + 1, 0);
  for (int64_t j = 0; j < p.kb; ++j) {
    if (ptr[j + 1] < ptr[j]) return Invalid("col_ptr must not decrease");
    std::fill(cols.begin() + ptr[j], cols.begin() + ptr[j + 1], static_cast<int32_t>(j));
  }
  for (int64_t b = 0; b < p.cap; ++b) {
    if (rows[b] < 0 || rows[b] >= p.mb)
      return Invalid("row_ids[" + std::to_string(b) + "] = " + std::to_string(rows[b]) + " outside [0, " +
                     std::to_string(p.mb) + ")");
    ++panel_start[rows[b] / p.panel + 1];
  }
  for (int64_t i = 0; i < p.panels; ++i) panel_start[i + 1] += panel_start[i];
  std::vector<int32_t> fill(panel_start.begin(), panel_start.end() - 1);
  for (int64_t b = 0; b < p.cap; ++b) order[fill[rows[b] / p.panel]++] = static_cast<int32_t>(b);

  p.values = values.untyped_data();
  p.scales = scales.typed_data();
  p.rows = rows;
  p.cols = cols.data();
  p.order = order.data();
  p.panel_start = panel_start.data();
  p.dy = dy.typed_data();
  p.out = out->typed_data();

  const Path path = PathFor(isa);
  const int64_t tiles = (p.n + path.tile - 1) / path.tile;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Narrow results (N = 384 is 4 AVX2 tiles; a 16-thread pool) leave threads idle unless a tile's
  // block-columns are split too: aim for two items per thread. Each split re-reads the dy panels,
  // and the sums of each dW element keep their order, so results do not depend on the split.
  p.groups = tiles ? std::clamp<int64_t>((2 * threads + tiles - 1) / tiles, 1, std::max<int64_t>(p.kb, 1)) : 1;
  ShareOut(pool, tiles * p.groups, [p, path](const auto& next_item) { Drain(p, path, next_item); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace bsr_jax

// Bit (1 << isa) for each instruction set this CPU and OS support (portable always), for ctypes.
extern "C" int32_t BsrJaxCpuIsaMask() { return bsr_jax::IsaMask(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsrTMatmul, bsr_jax::BsrTMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bm")
                                  .Attr<int64_t>("bk")
                                  .Attr<int64_t>("isa"));
