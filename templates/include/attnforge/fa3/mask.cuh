// Role: masking as a policy: which kv tiles a work item visits (its range narrowed to the keys
//   some row sees, tiles kBlockN apart, where each starts), and of those which need per-element
//   masking and which keys each row sees (KeyMask: the key bound, causality, the sliding window).
// Contract: causal is bottom-right aligned (q_pos = token + kv_len - qo_len); tiles past the
//   diagonal or before the window are never loaded; only tiles that straddle a boundary are masked
//   element by element. Both roles derive the same tiles from the same WorkTile.
// Must not: read or write memory; the scores themselves are masked in softmax.cuh (transform_scores).
#pragma once

#include "traits.cuh"

namespace attnforge::fa3 {

// Which tiles: the item's kv range [begin, end) narrowed to the keys some row sees (end at the
// causal diagonal of its last row, begin at the window of its first), so no tile past them loads.
template <typename T>
__device__ __forceinline__ void narrow_to_visible_keys(const typename T::Params& p, WorkTile& w) {
  if (p.causal) w.end = min(w.end, w.last_token + w.pos_shift + 1);
  if constexpr (T::kSlidingWindow) {
    if (p.window_left >= 0) w.begin = max(w.begin, w.first_token + w.pos_shift - p.window_left);
  }
}

// Tile 0's first key: w.begin, or with V transposed ahead the kBlockN multiple at or before it,
// where the request's transposed block starts.
template <typename T>
__device__ __forceinline__ int tile_origin(const WorkTile& w) {
  return T::kVtAhead ? w.begin / T::kBlockN * T::kBlockN : w.begin;
}

template <typename T>
__device__ __forceinline__ int num_kv_tiles(const WorkTile& w) {
  return w.end > w.begin ? (w.end - tile_origin<T>(w) + T::kBlockN - 1) / T::kBlockN : 0;
}

// Tile n's first key. Tiles cover the item's keys from w.begin on, kBlockN apart (tile n "from"
// w.begin + n kBlockN); a ragged item's partial last tile, where the request holds kBlockN keys
// up to w.end, starts at w.end - kBlockN instead, reaching back over keys the tile before it took
// (KeyMask hides those): it stays inside the request and is one TMA box instead of a gathered
// copy (cp.async, zero-filled past w.end).
// With V transposed ahead the tiles are the transposed blocks (tile_origin on, kBlockN apart): the
// first may reach back before w.begin, the last past w.end (its V^T is zeros there, and the mask
// hides the keys whatever K holds).
template <typename T>
__device__ __forceinline__ int tile_from(const WorkTile& w, int n) {
  if constexpr (T::kVtAhead) return max(w.begin, tile_origin<T>(w) + n * T::kBlockN);
  return w.begin + n * T::kBlockN;
}
template <typename T>
__device__ __forceinline__ int tile_first(const WorkTile& w, int n) {
  if constexpr (T::kVtAhead) return tile_origin<T>(w) + n * T::kBlockN;
  const int from = tile_from<T>(w, n);
  if constexpr (T::kPagedKV) return from;
  return from + T::kBlockN > w.end && w.end >= T::kBlockN ? w.end - T::kBlockN : from;
}

// Which keys the rows see: a tile's keys from its `from` on (tile_first), then `end`, causality and
// the window cut.
template <typename T>
struct KeyMask {
  int end, pos_shift, window_left, q_pos_first, q_pos_last;
  bool causal;

  // Every row sees every key of the tile starting at `first` unless this says otherwise.
  __device__ __forceinline__ bool tile_needs_mask(int first, int from) const {
    const int last = first + T::kBlockN - 1;
    bool needs = first < from || last >= end || (causal && last > q_pos_first);
    if constexpr (T::kSlidingWindow) needs = needs || (window_left >= 0 && first < q_pos_last - window_left);
    return needs;
  }
  __device__ __forceinline__ bool visible(int key, int from, int q_pos) const {
    bool ok = key >= from && key < end && (!causal || key <= q_pos);
    if constexpr (T::kSlidingWindow) ok = ok && (window_left < 0 || key >= q_pos - window_left);
    return ok;
  }
};

template <typename T>
__device__ __forceinline__ KeyMask<T> key_mask(const typename T::Params& p, const WorkTile& w) {
  return {w.end, w.pos_shift, p.window_left, w.first_token + w.pos_shift, w.last_token + w.pos_shift, p.causal != 0};
}

}  // namespace attnforge::fa3
