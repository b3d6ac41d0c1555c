// Role: entry header of the FA2 batch prefill kernel (tensor cores, paged or ragged KV); the one
//   header templates/prefill_variant.cu.jinja includes. It includes the role headers in order:
//     prefill_traits.cuh    dtypes, tile shape, warp split, shared-memory layout
//     prefill_state.cuh     a thread's rows: row range, online-softmax state, fragment element maps
//     prefill_loads.cuh     global -> shared copies of Q, K and V (cp.async, paged offsets, RoPE)
//     prefill_mma.cuh       fragment loads and the Q.K / P.V MMAs (fp8 KV widened to fp16)
//     prefill_mask.cuh      score scale, ALiBi bias, soft cap and masks
//     prefill_softmax.cuh   online-softmax update and the column split's warp merge
//     prefill_epilogue.cuh  normalize and store o / lse, or the fp32 partial rows
//     prefill_kernel.cuh    the kernel, its launch and its occupancy query
//
// Contract: including it defines everything a generated prefill translation unit names
//   (PrefillTraits, PosEncoding, launch_prefill, prefill_occupancy). The common headers come
//   first, in one fixed order, so every translation unit sees the same declarations in the same
//   order whichever role header needs them first.
//
// Must not: define anything itself.
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/plan_image.cuh"
#include "../common/rope.cuh"
#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"
#include "prefill_loads.cuh"
#include "prefill_mma.cuh"
#include "prefill_mask.cuh"
#include "prefill_softmax.cuh"
#include "prefill_epilogue.cuh"
#include "prefill_kernel.cuh"
