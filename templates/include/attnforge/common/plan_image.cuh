// Role: the fixed slots at the head of the int32 plan image that plan() writes and kernels read.
// Contract: the Python planner writes the same slots (attnforge.codegen.abi.PLAN_HEADER); a module
// reports these values through <uri>_abi() and the loader refuses a module whose slots differ.
// Must not: hold per-request data; those arrays sit at offsets carried in the params structs.
#pragma once

namespace attnforge::common {

constexpr int kPlanNumWork = 0;      // work items this plan really launched (the grid may be padded)
constexpr int kPlanError = 1;        // sticky error bits raised by kernels
constexpr int kPlanNumPartials = 2;  // fp32 partial slots in use
constexpr int kPlanJobCounter = 3;   // fa3 prefill's next-job counter: 0 between launches
constexpr int kPlanHeaderSlots = 4;

constexpr int kPlanErrorBadPage = 1;  // a page id outside [0, num_pages)

}  // namespace attnforge::common
