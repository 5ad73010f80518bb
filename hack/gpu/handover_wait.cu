// How long the GPU idles when exclusive turns pass from one process to another, when the next
// process is woken on the host against when its work is already queued behind a
// stream-ordered wait. Two processes (two contexts, as two tenants) take turns of K kernels;
// every kernel stamps the GPU's global timer at its first block's start and its last block's
// end. Modes:
//   alone     one process, turn after turn (its own sync and launch between turns)
//   host      the next process blocks on a pipe, the holder writes it once its work is done
//             (cuStreamSynchronize): the path of gem-schd's Grant today
//   host_spin the same, the next process polling a shared word instead of blocking
//   gpu_host  the next process's turn is queued ahead behind cuStreamWaitValue32 on a shared,
//             registered host word, which the holder's CPU stores once its work is done: what
//             gem-schd could store at the holder's report
//   gpu_dev   the same word written by the holder's own stream (cuStreamWriteValue32) after
//             its last kernel: the bound, with no host in the path
// In the gpu modes AHEAD_US > 0 queues the next turn only that long before the previous turn
// is due to end (a turn's length measured alone), instead of for the whole turn, to see what a
// context blocked on a wait costs the one that runs. Prints one JSON object per mode: the gap
// from one turn's last kernel end to the next turn's first kernel start (p50 / p90 / max, ms),
// the GPU busy over the run, and the kernels' durations (median; the first of each turn apart)
// against the same kernels alone.
//   nvcc -O2 -o handover_wait hack/gpu/handover_wait.cu -lcuda
//   ./handover_wait [TURNS] [KERNELS] [ITERS] [AHEAD_US] [MODE ...]
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                          \
  do {                                                                                 \
    CUresult r_ = (x);                                                                 \
    if (r_ != CUDA_SUCCESS) {                                                          \
      const char *s_ = "?";                                                            \
      cuGetErrorName(r_, &s_);                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);                   \
      _exit(3);                                                                        \
    }                                                                                  \
  } while (0)

// Each kernel's first starting block writes the start, its last finishing block the end.
__global__ void work(unsigned long long *stamps, unsigned *counters, int idx, int iters) {
  __shared__ bool first;
  if (threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    first = atomicAdd(&counters[2 * idx], 1) == 0;
    if (first) stamps[2 * idx] = t;
  }
  float x = threadIdx.x * 1e-3f;
  for (int i = 0; i < iters; i++) x = x * 0.999999f + 1e-4f;
  if (x == -1.0f) stamps[0] = 0;  // keeps the loop
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&counters[2 * idx + 1], 1) == gridDim.x - 1) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      stamps[2 * idx + 1] = t;
    }
  }
}

struct Shared {
  volatile uint32_t flag;  // the GPU's word: its own page, registered by both processes
  char pad[4096 - 4];
  std::atomic<int> ready;
  std::atomic<int> spin_turn;
};

static uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(p * v.size()))];
}

struct Run {
  int turns, kernels, iters, ahead_us;
  std::string mode;
  double turn_ns;  // a turn's length alone, for AHEAD_US
};

static void child(int p, int nproc, const Run &run, Shared *sh, unsigned long long *out,
                  int pin, int pout) {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr dflag = 0;
  bool gpu = run.mode == "gpu_host" || run.mode == "gpu_dev";
  if (gpu) {
    CK(cuMemHostRegister((void *)&sh->flag, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CK(cuMemHostGetDevicePointer(&dflag, (void *)&sh->flag, 0));
  }
  int n = run.turns * run.kernels;
  unsigned long long *stamps;
  unsigned *counters;
  cudaMalloc(&stamps, sizeof(unsigned long long) * 2 * (n + 1));
  cudaMalloc(&counters, sizeof(unsigned) * 2 * (n + 1));
  cudaMemset(stamps, 0, sizeof(unsigned long long) * 2 * (n + 1));
  cudaMemset(counters, 0, sizeof(unsigned) * 2 * (n + 1));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  // Warm-up on the last counter slot, which no turn uses.
  work<<<sms * 2, 256, 0, (cudaStream_t)s>>>(stamps, counters, n, 10);
  CK(cuStreamSynchronize(s));
  sh->ready.fetch_add(1);
  while (sh->ready.load() < nproc) {
  }
  auto launch_turn = [&](int t) {
    for (int k = 0; k < run.kernels; k++)
      work<<<sms * 2, 256, 0, (cudaStream_t)s>>>(stamps, counters, t * run.kernels + k, run.iters);
  };
  char b = 0;
  for (int t = p; t < run.turns; t += nproc) {
    if (run.mode == "alone") {
      launch_turn(t);
      CK(cuStreamSynchronize(s));
    } else if (run.mode == "host") {
      if (t > 0 && read(pin, &b, 1) != 1) _exit(4);
      launch_turn(t);
      CK(cuStreamSynchronize(s));
      if (write(pout, &b, 1) != 1) _exit(4);
    } else if (run.mode == "host_spin") {
      while (sh->spin_turn.load(std::memory_order_acquire) < t) {
      }
      launch_turn(t);
      CK(cuStreamSynchronize(s));
      sh->spin_turn.store(t + 1, std::memory_order_release);
    } else {
      if (run.ahead_us > 0 && t > 0) {
        // The previous turn started about when this process's own last one ended.
        uint64_t due = now_ns() + (uint64_t)run.turn_ns - (uint64_t)run.ahead_us * 1000;
        while (now_ns() < due) usleep(50);
      }
      CK(cuStreamWaitValue32(s, dflag, (cuuint32_t)t, CU_STREAM_WAIT_VALUE_GEQ));
      launch_turn(t);
      if (run.mode == "gpu_dev") CK(cuStreamWriteValue32(s, dflag, (cuuint32_t)(t + 1), 0));
      CK(cuStreamSynchronize(s));
      if (run.mode == "gpu_host") __atomic_store_n(&sh->flag, (uint32_t)(t + 1), __ATOMIC_RELEASE);
    }
  }
  std::vector<unsigned long long> h(2 * n);
  cudaMemcpy(h.data(), stamps, sizeof(unsigned long long) * 2 * n, cudaMemcpyDeviceToHost);
  for (int t = p; t < run.turns; t += nproc)
    for (int k = 0; k < run.kernels; k++) {
      int i = t * run.kernels + k;
      out[2 * i] = h[2 * i];
      out[2 * i + 1] = h[2 * i + 1];
    }
  if (gpu) cuMemHostUnregister((void *)&sh->flag);
  _exit(0);
}

struct Result {
  double gap_p50, gap_p90, gap_max, busy, dur_med, first_med, turn_ms;
};

static Result measure(const Run &run) {
  int n = run.turns * run.kernels;
  size_t bytes = sizeof(Shared) + sizeof(unsigned long long) * 2 * n;
  void *mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) { perror("mmap"); exit(1); }
  memset(mem, 0, bytes);
  Shared *sh = new (mem) Shared();
  auto *out = (unsigned long long *)((char *)mem + sizeof(Shared));
  int nproc = run.mode == "alone" ? 1 : 2;
  int a2b[2], b2a[2];
  if (pipe(a2b) || pipe(b2a)) { perror("pipe"); exit(1); }
  pid_t pids[2];
  for (int p = 0; p < nproc; p++) {
    pids[p] = fork();
    if (pids[p] == 0) {
      if (p == 0) child(0, nproc, run, sh, out, b2a[0], a2b[1]);
      else child(1, nproc, run, sh, out, a2b[0], b2a[1]);
    }
  }
  bool ok = true;
  for (int p = 0; p < nproc; p++) {
    int st = 0;
    waitpid(pids[p], &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  close(a2b[0]); close(a2b[1]); close(b2a[0]); close(b2a[1]);
  if (!ok) { fprintf(stderr, "mode %s: a child failed\n", run.mode.c_str()); exit(1); }
  std::vector<double> gaps, durs, firsts, turns;
  double busy = 0;
  int K = run.kernels;
  for (int t = 0; t < run.turns; t++) {
    for (int k = 0; k < K; k++) {
      int i = t * K + k;
      double d = (double)(out[2 * i + 1] - out[2 * i]);
      busy += d;
      (k == 0 ? firsts : durs).push_back(d);
    }
    turns.push_back((double)(out[2 * (t * K + K - 1) + 1] - out[2 * t * K]));
    if (t > 0) gaps.push_back((double)out[2 * t * K] - (double)out[2 * ((t - 1) * K + K - 1) + 1]);
  }
  // The first turns of each process are its start-up: judged from the fourth turn on.
  gaps.erase(gaps.begin(), gaps.begin() + std::min<size_t>(4, gaps.size()));
  double span = (double)(out[2 * (n - 1) + 1] - out[2 * 4 * K]);
  double busy_tail = 0;
  for (int i = 4 * K; i < n; i++) busy_tail += (double)(out[2 * i + 1] - out[2 * i]);
  munmap(mem, bytes);
  return {pct(gaps, 0.5) / 1e6, pct(gaps, 0.9) / 1e6, pct(gaps, 1.0) / 1e6, busy_tail / span,
          pct(durs, 0.5) / 1e3, pct(firsts, 0.5) / 1e3, pct(turns, 0.5) / 1e6};
}

int main(int argc, char **argv) {
  Run run{argc > 1 ? atoi(argv[1]) : 400, argc > 2 ? atoi(argv[2]) : 50,
          argc > 3 ? atoi(argv[3]) : 20000, argc > 4 ? atoi(argv[4]) : 0, "", 0};
  if (run.turns < 8 || run.kernels < 1 || run.iters < 1 || run.ahead_us < 0) {
    fprintf(stderr, "usage: handover_wait [TURNS>=8] [KERNELS] [ITERS] [AHEAD_US] [MODE ...]\n");
    return 2;
  }
  std::vector<std::string> modes;
  for (int i = 5; i < argc; i++) modes.push_back(argv[i]);
  if (modes.empty()) modes = {"alone", "host", "host_spin", "gpu_host", "gpu_dev"};
  run.mode = "alone";
  Result alone = measure(run);
  run.turn_ns = alone.turn_ms * 1e6;
  for (auto &m : modes) {
    run.mode = m;
    Result r = m == "alone" ? alone : measure(run);
    printf("{\"mode\":\"%s\",\"turns\":%d,\"kernels\":%d,\"ahead_us\":%d,\"turn_ms\":%.3f,"
           "\"gap_ms\":{\"p50\":%.4f,\"p90\":%.4f,\"max\":%.4f},\"busy\":%.4f,"
           "\"kernel_us\":{\"median\":%.2f,\"first_of_turn\":%.2f,\"alone\":%.2f,"
           "\"alone_first\":%.2f}}\n",
           m.c_str(), run.turns, run.kernels, run.ahead_us, r.turn_ms, r.gap_p50, r.gap_p90,
           r.gap_max, r.busy, r.dur_med, r.first_med, alone.dur_med, alone.first_med);
    fflush(stdout);
  }
  return 0;
}
