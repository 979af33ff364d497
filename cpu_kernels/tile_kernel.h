// One work item of dW = x.T @ dy from kept blocks: the arithmetic of cpu_kernels/bsr_t_matmul.cc, as
// templates on a register-blocking shape (one per instruction set) and on the stored value type.
//
// Everything here is always inlined into the per-instruction-set entry points of bsr_t_matmul.cc,
// which carry the target attributes: GCC and clang then emit AVX-512, AVX2 or baseline code for
// the same source, and the caller picks one at run time (no -march flag at build time).

#ifndef BSR_JAX_CPU_KERNELS_TILE_KERNEL_H_
#define BSR_JAX_CPU_KERNELS_TILE_KERNEL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#define BSR_INLINE [[gnu::always_inline]] inline

namespace bsr_jax {

// How the kept values are stored (bsr_jax/quantize.py): int8 and int4 carry one f32 scale per block.
enum class Stored : int32_t { kF32 = 0, kBF16 = 1, kInt8 = 2, kInt4 = 3 };

struct Problem {
  const void* values;      // (cap, bm, bk) f32 / bf16 / int8, or (cap, ceil(bm*bk/2)) packed int4
  const float* scales;     // (cap,) for int8 / int4, else unused
  Stored stored;
  const int32_t* rows;     // (cap,) block-row of each block
  const int32_t* cols;     // (cap,) block-column of each block
  const int32_t* order;    // (cap,) block indices by panel, then as stored (by column)
  const int32_t* panel_start;  // (panels + 1,) panel i's blocks are order[panel_start[i]:panel_start[i + 1]]
  const float* dy;         // (Mb * bm, N)
  float* out;              // (Kb * bk, N)
  int64_t cap, bm, bk, mb, kb, n;  // cap: used slots
  int64_t panel, panels;   // block-rows per panel (kPanelRows / bm, at least 1), and their number
  int64_t groups;          // block-column groups per tile (work items: tiles x groups)
};

// A register-blocking shape: Vec holds W floats; the micro-kernel keeps a G x V grid of Vecs as
// accumulators (G rows of dW, V * W of its columns), and a dW tile is Tile columns wide.
template <class VecT, int kG, int kV, int kTileCols>
struct Blocking {
  using Vec = VecT;
  static constexpr int W = sizeof(VecT) / sizeof(float);
  static constexpr int G = kG;
  static constexpr int V = kV;
  static constexpr int64_t Tile = kTileCols;
  static_assert(kTileCols % (kV * (sizeof(VecT) / sizeof(float))) == 0, "a tile holds whole G x V steps");
};

// Unaligned vector access. (memcpy of a whole vector made GCC 12 copy each accumulator through the
// stack in 16-byte pieces, a third of the AVX2 path's time.)
template <class Vec>
BSR_INLINE Vec Load(const float* p) {
  typedef Vec Unaligned __attribute__((aligned(alignof(float)), may_alias));
  return *reinterpret_cast<const Unaligned*>(p);
}

template <class Vec>
BSR_INLINE void Store(float* p, Vec v) {
  typedef Vec Unaligned __attribute__((aligned(alignof(float)), may_alias));
  *reinterpret_cast<Unaligned*>(p) = v;
}

// Kept blocks of one block-column within one panel of block-rows: their products are summed in
// the same registers, so the dW rows they share are loaded and stored once per run, not per block.
constexpr int kPanelRows = 64;  // rows of dy per panel: 64 x Tile floats stay in L1
constexpr int kMaxRun = kPanelRows;  // blocks per run: at most one per block-row of a panel

struct Run {
  const float* v[kMaxRun];   // each block's values, bm x bk
  const float* dy[kMaxRun];  // each block's bm rows of the packed dy panel
  int count = 0;
};

// out[c, e] += sum over the run's blocks and r of v[r, c] * dy[r, e], for c in [c0, c0 + G) and
// e in [e0, e0 + V * W); out and dy rows are ld floats apart, v rows bk. The G x V accumulators, V
// dy vectors and one broadcast must fit the register file, or the loop spills (issue 23's AVX2
// slowdown).
template <class Vec, int G, int V>
BSR_INLINE void UpdateVectors(const Run& run, int64_t bm, int64_t bk, int64_t c0, int64_t e0, float* out,
                              int64_t ld) {
  constexpr int W = sizeof(Vec) / sizeof(float);
  Vec acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < V; ++e) acc[g][e] = Load<Vec>(out + (c0 + g) * ld + e0 + W * e);
  for (int i = 0; i < run.count; ++i) {
    const float* v = run.v[i] + c0;
    const float* dy = run.dy[i] + e0;
    for (int64_t r = 0; r < bm; ++r) {
      Vec d[V];
      for (int e = 0; e < V; ++e) d[e] = Load<Vec>(dy + r * ld + W * e);
      for (int g = 0; g < G; ++g) {
        const float s = v[r * bk + g];
        for (int e = 0; e < V; ++e) acc[g][e] += s * d[e];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < V; ++e) Store<Vec>(out + (c0 + g) * ld + e0 + W * e, acc[g][e]);
}

template <class Vec, int G, int V>
BSR_INLINE void UpdateColumns(const Run& run, int64_t bm, int64_t bk, int64_t e0, float* out, int64_t ld) {
  int64_t c0 = 0;
  for (; c0 + G <= bk; c0 += G) UpdateVectors<Vec, G, V>(run, bm, bk, c0, e0, out, ld);
  for (; c0 < bk; ++c0) UpdateVectors<Vec, 1, V>(run, bm, bk, c0, e0, out, ld);
}

// A run's update of `width` columns, a multiple of W up to B::Tile: whole G x V steps, then
// single vectors.
template <class B>
BSR_INLINE void UpdateRun(const Run& run, int64_t bm, int64_t bk, float* out, int64_t ld, int64_t width) {
  int64_t e0 = 0;
  for (; e0 + B::V * B::W <= width; e0 += B::V * B::W)
    UpdateColumns<typename B::Vec, B::G, B::V>(run, bm, bk, e0, out, ld);
  for (; e0 < width; e0 += B::W) UpdateColumns<typename B::Vec, B::G, 1>(run, bm, bk, e0, out, ld);
}

// Block b's values as bm * bk floats: f32 blocks in place, others decoded (and scaled) into
// `scratch`, once per block and tile. Decoding costs bm * bk operations against the bm * bk * Tile
// multiply-adds of the block, and keeps the micro-kernel the same for every stored type.
template <Stored S>
BSR_INLINE const float* BlockValues(const Problem& p, int64_t b, float* scratch) {
  const int64_t size = p.bm * p.bk;
  if constexpr (S == Stored::kF32) {
    return static_cast<const float*>(p.values) + b * size;
  } else if constexpr (S == Stored::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(p.values) + b * size;
    for (int64_t i = 0; i < size; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;  // bf16 is f32's upper half
      std::memcpy(scratch + i, &bits, sizeof bits);
    }
  } else if constexpr (S == Stored::kInt8) {
    const int8_t* src = static_cast<const int8_t*>(p.values) + b * size;
    const float scale = p.scales[b];
    for (int64_t i = 0; i < size; ++i) scratch[i] = static_cast<float>(src[i]) * scale;
  } else {
    // Two 4-bit two's-complement values per byte, low nibble first; an odd size pads the last high nibble.
    const uint8_t* src = static_cast<const uint8_t*>(p.values) + b * ((size + 1) / 2);
    const float scale = p.scales[b];
    for (int64_t i = 0; i < size / 2; ++i) {
      const int8_t byte = static_cast<int8_t>(src[i]);
      scratch[2 * i] = static_cast<float>(static_cast<int8_t>(byte << 4) >> 4) * scale;
      scratch[2 * i + 1] = static_cast<float>(byte >> 4) * scale;
    }
    if (size % 2) scratch[size - 1] = static_cast<float>(static_cast<int8_t>(src[size / 2] << 4) >> 4) * scale;
  }
  return scratch;
}

// Per-thread buffers, in floats: `values` panel * bm * bk (a run's decoded blocks), `panel`
// panel * bm * Tile (dy's rows of the current panel), `tile` Kb * bk * Tile (the dW tile).
struct Workspace {
  float* values;
  float* panel;
  float* tile;
};

// Work item `item` of dW: tile item / groups (its B::Tile columns) of the block-columns in group
// item % groups (all groups when the tiles alone are enough to share out between the threads).
// Block-rows are taken a panel of p.panel at a time (kPanelRows rows of dy; p.order lists each
// panel's blocks by column), so a panel of dy is read from memory once and reused from L1 by all
// its kept blocks. The panel and the dW tile are copied into contiguous buffers: in place their
// rows lie N floats apart, and at N = 1536 (6 KiB) they fall into two L1 sets' worth of lines and
// evict each other (the AVX2 path ran 40% slower there than at N = 384).
template <class B, Stored S>
BSR_INLINE void RunItemTyped(const Problem& p, int64_t item, const Workspace& w) {
  constexpr int64_t ld = B::Tile;
  const int64_t n0 = item / p.groups * ld;
  const int64_t width = std::min(ld, p.n - n0);
  const int64_t vector_width = (width + B::W - 1) / B::W * B::W;
  const int64_t col_begin = item % p.groups * p.kb / p.groups;
  const int64_t col_end = (item % p.groups + 1) * p.kb / p.groups;
  const int64_t block_size = p.bm * p.bk;
  float* const tile = w.tile + col_begin * p.bk * ld;
  std::memset(tile, 0, (col_end - col_begin) * p.bk * ld * sizeof(float));
  const auto column_before = [&](int32_t b, int64_t col) { return p.cols[b] < col; };
  for (int64_t panel = 0; panel < p.panels; ++panel) {
    const int32_t* first = p.order + p.panel_start[panel];
    const int32_t* last = p.order + p.panel_start[panel + 1];
    if (p.groups > 1) {
      first = std::lower_bound(first, last, col_begin, column_before);
      last = std::lower_bound(first, last, col_end, column_before);
    }
    if (first == last) continue;
    const int64_t first_row = panel * p.panel * p.bm;
    const int64_t rows = std::min(p.panel * p.bm, p.mb * p.bm - first_row);
    // The last tile's columns past N are zeros in the panel, so whole vectors run over them (into
    // dW columns that are never copied out) instead of a scalar loop.
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(w.panel + r * ld, p.dy + (first_row + r) * p.n + n0, width * sizeof(float));
      std::memset(w.panel + r * ld + width, 0, (vector_width - width) * sizeof(float));
    }
    for (const int32_t* q = first; q < last;) {
      const int64_t col = p.cols[*q];
      Run run;
      for (; q < last && p.cols[*q] == col && run.count < p.panel; ++q, ++run.count) {
        run.v[run.count] = BlockValues<S>(p, *q, w.values + run.count * block_size);
        run.dy[run.count] = w.panel + (p.rows[*q] * p.bm - first_row) * ld;
      }
      UpdateRun<B>(run, p.bm, p.bk, w.tile + col * p.bk * ld, ld, vector_width);
    }
  }
  for (int64_t k = col_begin * p.bk; k < col_end * p.bk; ++k)
    std::memcpy(p.out + k * p.n + n0, w.tile + k * ld, width * sizeof(float));
}

template <class B>
BSR_INLINE void RunItem(const Problem& p, int64_t item, const Workspace& w) {
  switch (p.stored) {
    case Stored::kF32: return RunItemTyped<B, Stored::kF32>(p, item, w);
    case Stored::kBF16: return RunItemTyped<B, Stored::kBF16>(p, item, w);
    case Stored::kInt8: return RunItemTyped<B, Stored::kInt8>(p, item, w);
    case Stored::kInt4: return RunItemTyped<B, Stored::kInt4>(p, item, w);
  }
}

}  // namespace bsr_jax

#endif  // BSR_JAX_CPU_KERNELS_TILE_KERNEL_H_
