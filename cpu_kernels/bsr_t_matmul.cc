// x.T @ dy on the CPU for a block-sparse x, as an XLA FFI custom call (see cpu_kernels/__init__.py).
//
// XLA has no way to say "multiply only these blocks" without materialising a gather of dy, and
// the gather (one (bm, N) slab per kept block, 7x the size of dy at block 16) costs as much as the
// dense matmul it replaces. This kernel reads dy in place instead:
//
// * The result's N columns are cut into tiles of up to 64 floats; a tile of dW, (Kb * bk, 64) f32,
//   stays in L2 while every kept block is applied to it, and tiles are shared out between threads
//   of XLA's intra-op pool, each tile with exactly one writer (no atomics, deterministic).
// * Inside a tile, blocks are visited in block-row order (a counting sort of the column-major
//   layout), so the (bm, 64) slab of dy a block-row multiplies is loaded once from memory and
//   reused from L1 by every kept block of that row.
// * A block's update dW[j*bk + c, tile] += sum_r V[r, c] * dy[i*bm + r, tile] keeps a 4 x 64
//   accumulator in vector registers while it runs over the bm rows: 16 FMAs per 4 broadcasts and
//   4 vector loads.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float Vec16 __attribute__((vector_size(64), aligned(4)));

constexpr int64_t kTile = 64;         // floats of N per tile: four 16-float vectors
constexpr int64_t kColumnGroup = 4;   // dW rows accumulated in registers at once

[[gnu::always_inline]] inline Vec16 Load(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

[[gnu::always_inline]] inline void Store(float* p, const Vec16& v) { std::memcpy(p, &v, sizeof v); }

// out[c, e] += sum_r v[r, c] * dy[r, e] for c in [c0, c0 + G), e in [0, 16 * V), with out and dy
// rows n floats apart and v rows bk floats apart.
template <int G, int V>
[[gnu::always_inline]] inline void UpdateVectors(const float* v, int64_t bm, int64_t bk, int64_t c0, const float* dy,
                          float* out, int64_t n) {
  Vec16 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < V; ++e) acc[g][e] = Load(out + (c0 + g) * n + 16 * e);
  for (int64_t r = 0; r < bm; ++r) {
    Vec16 d[V];
    for (int e = 0; e < V; ++e) d[e] = Load(dy + r * n + 16 * e);
    for (int g = 0; g < G; ++g) {
      const float s = v[r * bk + c0 + g];
      for (int e = 0; e < V; ++e) acc[g][e] += s * d[e];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < V; ++e) Store(out + (c0 + g) * n + 16 * e, acc[g][e]);
}

// The same for the last width % 16 columns of a tile, one float at a time.
[[gnu::always_inline]] inline void UpdateScalars(const float* v, int64_t bm, int64_t bk, const float* dy, float* out,
                          int64_t n, int64_t width) {
  for (int64_t c = 0; c < bk; ++c)
    for (int64_t r = 0; r < bm; ++r) {
      const float s = v[r * bk + c];
      for (int64_t e = 0; e < width; ++e) out[c * n + e] += s * dy[r * n + e];
    }
}

template <int V>
[[gnu::always_inline]] inline void UpdateBlock(const float* v, int64_t bm, int64_t bk, const float* dy, float* out,
                        int64_t n) {
  int64_t c0 = 0;
  for (; c0 + kColumnGroup <= bk; c0 += kColumnGroup)
    UpdateVectors<kColumnGroup, V>(v, bm, bk, c0, dy, out, n);
  for (; c0 < bk; ++c0) UpdateVectors<1, V>(v, bm, bk, c0, dy, out, n);
}

struct Problem {
  const float* values;     // (cap, bm, bk)
  const int32_t* rows;     // (cap,) block-row of each block
  const int32_t* cols;     // (cap,) block-column of each block
  const int32_t* order;    // (cap,) block indices sorted by block-row
  const float* dy;         // (Mb * bm, N)
  float* out;              // (Kb * bk, N)
  int64_t cap, bm, bk, kb, n;  // cap: used slots
};

#if defined(__x86_64__) && defined(__GNUC__)
// One build runs on any x86-64; the loader picks the widest vector unit this CPU has.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void RunTile(const Problem& p, int64_t tile) {
  const int64_t n0 = tile * kTile;
  const int64_t width = std::min(kTile, p.n - n0);
  for (int64_t k = 0; k < p.kb * p.bk; ++k) std::memset(p.out + k * p.n + n0, 0, width * sizeof(float));
  for (int64_t q = 0; q < p.cap; ++q) {
    const int64_t b = p.order[q];
    const float* v = p.values + b * p.bm * p.bk;
    const float* dy = p.dy + p.rows[b] * p.bm * p.n + n0;
    float* out = p.out + p.cols[b] * p.bk * p.n + n0;
    int64_t e0 = 0;
    if (width == kTile) {
      UpdateBlock<kTile / 16>(v, p.bm, p.bk, dy, out, p.n);
      e0 = kTile;
    }
    for (; e0 + 16 <= width; e0 += 16) UpdateBlock<1>(v, p.bm, p.bk, dy + e0, out + e0, p.n);
    if (e0 < width) UpdateScalars(v, p.bm, p.bk, dy + e0, out + e0, p.n, width - e0);
  }
}

// Tiles go to whichever thread asks next. The calling thread works too and waits only for tiles
// already taken, so the call finishes even when no pool thread is free; state that a late helper
// may still touch lives in a shared_ptr.
struct TileQueue {
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mutex;
  std::condition_variable all_done;
};

void Drain(const Problem& p, int64_t tiles, TileQueue& queue) {
  for (int64_t t; (t = queue.next.fetch_add(1)) < tiles;) {
    RunTile(p, t);
    std::lock_guard<std::mutex> lock(queue.mutex);
    if (++queue.done == tiles) queue.all_done.notify_all();
  }
}

ffi::Error BsrTMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> row_ids,
                      ffi::Buffer<ffi::S32> col_ptr, ffi::Buffer<ffi::F32> dy,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto vdims = values.dimensions();
  const auto ddims = dy.dimensions();
  const auto odims = out->dimensions();
  if (vdims.size() != 3 || ddims.size() != 2 || col_ptr.element_count() < 1 || vdims[1] < 1 ||
      ddims[0] % vdims[1] != 0 || odims.size() != 2 || odims[0] != (col_ptr.element_count() - 1) * vdims[2] ||
      odims[1] != ddims[1] || row_ids.element_count() != static_cast<size_t>(vdims[0]))
    return ffi::Error::InvalidArgument(
        "bsr_t_matmul: want values (cap, bm, bk), row_ids (cap,), col_ptr (Kb + 1,), dy (Mb * bm, N) "
        "and a (Kb * bk, N) result");
  Problem p{};
  p.cap = vdims[0];
  p.bm = vdims[1];
  p.bk = vdims[2];
  p.kb = static_cast<int64_t>(col_ptr.element_count()) - 1;
  p.n = ddims[1];
  const int64_t mb = ddims[0] / p.bm;

  // Block-column of every block from col_ptr, then a counting sort by block-row.
  const int32_t* ptr = col_ptr.typed_data();
  const int32_t* rows = row_ids.typed_data();
  if (ptr[0] != 0 || ptr[p.kb] > p.cap)
    return ffi::Error::InvalidArgument("bsr_t_matmul: col_ptr must start at 0 and end at most at capacity");
  p.cap = ptr[p.kb];  // slots after the last column's are unused
  std::vector<int32_t> cols(p.cap), order(p.cap), row_start(mb + 1, 0);
  for (int64_t j = 0; j < p.kb; ++j) {
    if (ptr[j + 1] < ptr[j]) return ffi::Error::InvalidArgument("bsr_t_matmul: col_ptr must not decrease");
    std::fill(cols.begin() + ptr[j], cols.begin() + ptr[j + 1], static_cast<int32_t>(j));
  }
  for (int64_t b = 0; b < p.cap; ++b) {
    if (rows[b] < 0 || rows[b] >= mb)
      return ffi::Error::InvalidArgument("bsr_t_matmul: row_ids[" + std::to_string(b) + "] = " +
                                         std::to_string(rows[b]) + " outside [0, " + std::to_string(mb) + ")");
    ++row_start[rows[b] + 1];
  }
  for (int64_t i = 0; i < mb; ++i) row_start[i + 1] += row_start[i];
  for (int64_t b = 0; b < p.cap; ++b) order[row_start[rows[b]]++] = static_cast<int32_t>(b);

  p.values = values.typed_data();
  p.rows = rows;
  p.cols = cols.data();
  p.order = order.data();
  p.dy = dy.typed_data();
  p.out = out->typed_data();

  const int64_t tiles = (p.n + kTile - 1) / kTile;
  auto queue = std::make_shared<TileQueue>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tiles) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([p, tiles, queue] { Drain(p, tiles, *queue); });
  Drain(p, tiles, *queue);
  std::unique_lock<std::mutex> lock(queue->mutex);
  queue->all_done.wait(lock, [&] { return queue->done == tiles; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsrTMatmulF32, BsrTMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
