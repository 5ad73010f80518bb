// What accounting a tenant's own GPU time with CUDA events would cost it on the CPU (co-running
// needs the co-runner's GPU time, and events around its kernels keep the
// other context's time slices out). Interleaved rounds of N launches of an empty kernel on one
// stream, four ways: plain; one event recorded after each launch; an event before and after
// each launch; and the same with every pair's elapsed time read once the round is done. No
// hook: the driver's own cost. Prints one JSON line: ns per launch of each way (the round to
// its end, median and best, and the launch loop alone, which the CPU spends), and the GPU time
// the events measured per empty kernel.
//   nvcc -O2 -o event_cost hack/gpu/event_cost.cu && ./event_cost [ROUNDS] [LAUNCHES]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

__global__ void empty() {}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static double best(const std::vector<double> &v) { return *std::min_element(v.begin(), v.end()); }

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 30;
  int n = argc > 2 ? atoi(argv[2]) : 5000;
  if (rounds < 1 || n < 1) { fprintf(stderr, "ROUNDS and LAUNCHES must be positive\n"); return 2; }
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "CUDA init failed\n");
    return 1;
  }
  std::vector<cudaEvent_t> a(n), b(n);
  for (int i = 0; i < n; i++) {
    cudaEventCreate(&a[i]);
    cudaEventCreate(&b[i]);
  }
  empty<<<1, 1, 0, s>>>();
  cudaStreamSynchronize(s);
  std::vector<double> ns[4], cpu[4];
  double gpu_us = 0;
  for (int r = 0; r < rounds; r++) {
    for (int way = 0; way < 4; way++) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; i++) {
        if (way >= 2) cudaEventRecord(a[i], s);
        empty<<<1, 1, 0, s>>>();
        if (way >= 1) cudaEventRecord(b[i], s);
      }
      auto tl = std::chrono::steady_clock::now();
      cudaStreamSynchronize(s);
      if (way == 3) {
        double sum = 0;
        for (int i = 0; i < n; i++) {
          float ms = 0;
          cudaEventElapsedTime(&ms, a[i], b[i]);
          sum += ms;
        }
        gpu_us = 1000.0 * sum / n;
      }
      auto t1 = std::chrono::steady_clock::now();
      ns[way].push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / n);
      cpu[way].push_back(std::chrono::duration<double, std::nano>(tl - t0).count() / n);
    }
  }
  if (cudaGetLastError() != cudaSuccess) { fprintf(stderr, "a CUDA call failed\n"); return 1; }
  const char *names[4] = {"plain", "one_event", "two_events", "two_events_read"};
  printf("{\"rounds\": %d, \"launches\": %d", rounds, n);
  for (int w = 0; w < 4; w++)
    printf(", \"%s_ns\": {\"median\": %.1f, \"best\": %.1f, \"launch_loop_median\": %.1f}", names[w],
           median(ns[w]), best(ns[w]), median(cpu[w]));
  printf(", \"event_span_us_per_empty_kernel\": %.3f}\n", gpu_us);
  return 0;
}
