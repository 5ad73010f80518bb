// Per-launch cost of libgemhook: launches N empty kernels (a sync every 1000) and prints
// launches/s. Built and run by hack/gpu/launch-bench.sh, with and without the hook preloaded.
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cuda_runtime.h>

__global__ void empty() {}

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 200000;
  empty<<<1, 1>>>();  // context creation and module load outside the timing
  if (cudaDeviceSynchronize() != cudaSuccess) { fprintf(stderr, "CUDA init failed\n"); return 1; }
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; i++) {
    empty<<<1, 1>>>();
    if (i % 1000 == 999) cudaDeviceSynchronize();
  }
  cudaDeviceSynchronize();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (cudaGetLastError() != cudaSuccess) { fprintf(stderr, "launch failed\n"); return 1; }
  printf("%.0f\n", n / s);
  return 0;
}
