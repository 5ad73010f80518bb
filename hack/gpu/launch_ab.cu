// The hook's added CPU time per cuLaunchKernel, measured inside one process so that the noise
// of separate runs (clock modes, placement) cannot hide it: interleaved rounds of N launches of
// an empty kernel through the hook's cuLaunchKernel (what the program's dlsym returns with
// libgemhook preloaded) and through the driver's own (looked up with glibc's real dlsym, which
// the hook does not intercept). Prints one JSON line: ns per launch of each path, and their
// difference per round pair, best-of and median.
//   launch_ab ROUNDS LAUNCHES        (built and run by hack/gpu/launch-ab.sh)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <dlfcn.h>
#include <cuda.h>
#include <cuda_runtime.h>

__global__ void empty() {}

typedef CUresult (*Launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUstream, void **, void **);
typedef void *(*Dlsym)(void *, const char *);

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 200;
  long n = argc > 2 ? atol(argv[2]) : 10000;
  empty<<<1, 1>>>();  // context, module
  if (cudaDeviceSynchronize() != cudaSuccess) { fprintf(stderr, "CUDA init failed\n"); return 1; }
  CUfunction f;
  if (cudaGetFuncBySymbol(&f, (const void *)empty) != cudaSuccess) { fprintf(stderr, "no CUfunction\n"); return 1; }
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  // glibc's own dlsym, looked up inside libc only (the preloaded hook exports a dlsym too).
  void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  Dlsym real_dlsym = libc ? (Dlsym)dlvsym(libc, "dlsym", "GLIBC_2.34") : nullptr;
  if (!real_dlsym && libc) real_dlsym = (Dlsym)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
  if (!lib || !real_dlsym) { fprintf(stderr, "no libcuda or real dlsym\n"); return 1; }
  Launch hooked = (Launch)dlsym(lib, "cuLaunchKernel");  // the hook's wrapper when preloaded
  Launch raw = (Launch)real_dlsym(lib, "cuLaunchKernel");  // the driver's own
  bool distinct = hooked != raw;
  auto run = [&](Launch fn) {
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; i++) {
      fn(f, 1, 1, 1, 1, 1, 1, 0, 0, nullptr, nullptr);
    }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
    cudaDeviceSynchronize();  // outside the timing: each round starts with an empty queue
    return ns;
  };
  run(hooked);  // warm-up: the hook connects and takes the token
  run(raw);
  std::vector<double> h, r, d;
  for (int i = 0; i < rounds; i++) {
    double a, b;
    if (i % 2 == 0) { a = run(hooked); b = run(raw); } else { b = run(raw); a = run(hooked); }
    h.push_back(a); r.push_back(b); d.push_back(a - b);
  }
  if (cudaGetLastError() != cudaSuccess) { fprintf(stderr, "launch failed\n"); return 1; }
  double bh = *std::min_element(h.begin(), h.end()), br = *std::min_element(r.begin(), r.end());
  printf("{\"rounds\": %d, \"launches_per_round\": %ld, \"hook_wraps_launch\": %s, "
         "\"hooked_ns\": {\"best\": %.1f, \"median\": %.1f}, \"raw_ns\": {\"best\": %.1f, \"median\": %.1f}, "
         "\"added_ns\": {\"best_of_bests\": %.1f, \"median_of_pairs\": %.1f}}\n",
         rounds, n, distinct ? "true" : "false", bh, median(h), br, median(r), bh - br, median(d));
  return 0;
}
