// Role: the 128-byte XOR swizzle of a shared-memory tile of 16-byte cells.
// Contract: a row of kCells cells (kCells a multiple of 8, i.e. rows of >= 128 bytes); logical cell
//   (row, cell) lives at row * kCells + (cell ^ (row % 8)). Eight lanes touching the same logical
//   cell of eight consecutive rows (ldmatrix) or eight consecutive cells of one row (cp.async) then
//   hit eight distinct 16-byte bank groups: both sides are conflict-free.
// Must not: know element types; offsets are in cells, callers scale them.
#pragma once

namespace attnforge::common {

// Cells per row once a row of `cells` is padded to whole 128-byte lines (rows of fp8 head dims 64
// and 192); the padding cells are never copied or read.
constexpr int swizzle_row_cells(int cells) { return (cells + 7) / 8 * 8; }

template <int kCells>
struct Swizzle128 {
  static_assert(kCells % 8 == 0, "swizzle: a row must span whole 128-byte lines (>= 8 cells of 16 bytes)");
  static constexpr int kCellsPerRow = kCells;
  __device__ __forceinline__ static int cell(int row, int col) { return row * kCells + (col ^ (row & 7)); }
};

}  // namespace attnforge::common
