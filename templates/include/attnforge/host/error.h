// Role: how a module reports failure through its C ABI.
// Contract: entry points return 0 or a nonzero code; the message (module uri, kernel name and
// CUDA's error string) is kept per thread and read with <uri>_last_error(). With debug_sync set,
// every kernel is followed by a stream synchronize so asynchronous faults name their kernel.
// Must not: throw across the C boundary or print.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace attnforge::host {

inline std::string& last_error() {
  static thread_local std::string message;
  return message;
}

inline int32_t fail(int32_t code, const std::string& message) {
  last_error() = message;
  return code;
}

// Whether `stream` is capturing a CUDA graph: its launches run at replay, and synchronizing it
// would invalidate the capture.
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

// Checks a launch (and, when debugging outside a graph capture, its completion); 0 on success.
inline int32_t check_kernel(cudaError_t launch, const char* uri, const char* kernel, cudaStream_t stream,
                            bool debug_sync) {
  cudaError_t err = launch;
  if (err == cudaSuccess && debug_sync && !capturing(stream)) err = cudaStreamSynchronize(stream);
  if (err == cudaSuccess) return 0;
  return fail(static_cast<int32_t>(err), std::string(uri) + ": " + kernel + ": " + cudaGetErrorName(err) + ": " +
                                             cudaGetErrorString(err));
}

// Makes `device` current for the scope of a call, so kernels launch where the tensors live.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = previous_;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace attnforge::host
