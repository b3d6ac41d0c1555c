// Role: entry header of the FA2 batch decode kernel (one query token per request, paged KV); the
//   one header templates/decode_variant.cu.jinja includes. It includes the role headers in order:
//     decode_mma.cuh     the tensor-core tile (4-8 heads per CTA, rows of whole 128-byte lines)
//     decode_traits.cuh  thread layout, tile choice, KV ring, reduce-scatter shape, smem layout
//     decode_simt.cuh    the CUDA-core tile: dot products, reduce-scatter, softmax, P.V
//     (pos_encoding.cuh  the position-encoding tags and ALiBi slopes, shared with prefill)
//     decode_kernel.cuh  the kernel (ring, lane merge, stores), its launch and occupancy query
//
// Contract: including it defines everything a generated decode translation unit names
//   (DecodeTraits, launch_decode, decode_occupancy). The common headers come first, in one fixed
//   order, so every translation unit sees the same declarations in the same order whichever role
//   header needs them first.
//
// Must not: define anything itself.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/plan_image.cuh"
#include "../common/rope.cuh"
#include "../common/vec.cuh"

#include "pos_encoding.cuh"

#include "decode_mma.cuh"
#include "decode_traits.cuh"
#include "decode_simt.cuh"
#include "decode_kernel.cuh"
