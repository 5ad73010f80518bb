// A tenant's GPU activity and its context's time slices, from CUPTI (13.2 or later for the
// slices), for hack/gpu/mix_tenant.py: loaded with ctypes in place of torch.profiler.
//
// Kernel, copy and set records give when this process's work ran, as the GPU stamped it; but
// where two contexts share the GPU, the driver time-slices them and a kernel's record also
// spans the other context's slices. CUPTI's compute-engine context-switch records say when this
// context was switched in and out, so the part of its records inside its own slices is its GPU
// time, exact under time-slicing (not under MPS, where clients run side by side). The switch
// records come on a clock of their own, off by up to milliseconds and drifting: slices.py
// finds the shift from the records.
//
//   nvcc -O2 -shared -Xcompiler -fPIC -I CUPTI/include -o libgputrace.so hack/gpu/gputrace.cu
//     -L CUPTI/lib -l:libcupti.so.13 -Xlinker -rpath=CUPTI/lib      (one command)
//
// gt_start() enables the records and returns 0, or the CUPTI error of the kernel records; the
// context-switch records' own result is in the output (`e ctxsw N`: 0 when on);
// gt_start_switches() enables the switch records alone, gt_start_kernels() the kernel records
// alone; gt_start_switches_every(us) the switch records alone, flushed that often from a
// thread of their own (what a hook charging its tenant the slices it held would run), and
// gt_flush_stats() says what the flushes cost and how late the records came;
// gt_reset() turns them all off. Buffers are 16 MiB, or GPUTRACE_BUFFER_KB.
// gt_stop(path) flushes and writes one record a line:
//   o NS               add to a CUPTI timestamp to get the host's wall clock (CLOCK_REALTIME)
//   e WHAT CODE        what enabling each kind returned; `e version N`: CUPTI's API version
//   k START END CORR K  a kernel (K: k), copy (c) or set (s) (CUPTI ns; CORR: its launch's
//                      correlation id)
//   r CORR END         a runtime API call's return (CUPTI ns)
//   s TS OP CTX        context CTX switched in (OP 1) or out (OP 2) of the compute engine
//   c CTX              the context of this process's kernels
//   d N                records CUPTI dropped
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <thread>
#include <vector>
#include <cuda.h>
#include <cupti_activity.h>
#include <cupti_version.h>

namespace {

struct Span { uint64_t start, end; uint32_t corr; char kind; };
struct Ret { uint32_t corr; uint64_t end; };
struct Switch { uint64_t ts; uint32_t op, ctx; };

std::mutex mu;
std::vector<Span> spans;
std::vector<Ret> rets;
std::vector<Switch> switches;
uint32_t kernel_ctx = 0;
const CUpti_ActivityKind kinds[5] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_COMPUTE_ENGINE_CTX_SWITCH};
CUptiResult enabled[5] = {CUPTI_ERROR_UNKNOWN, CUPTI_ERROR_UNKNOWN, CUPTI_ERROR_UNKNOWN,
                          CUPTI_ERROR_UNKNOWN, CUPTI_ERROR_UNKNOWN};

// Buffers of 16 MiB, or GPUTRACE_BUFFER_KB, or small ones where a thread flushes them often:
// under a hook that flushes CUPTI every few ms each flush retires a buffer, and a new 16 MiB one
// is mapped and faulted in each time.
size_t default_buffer_size() {
  const char *v = getenv("GPUTRACE_BUFFER_KB");
  long kb = v ? atol(v) : 0;
  return kb > 0 ? static_cast<size_t>(kb) << 10 : static_cast<size_t>(16) << 20;
}
size_t buffer_size = default_buffer_size();
// The periodic flusher (gt_start_switches_every): its thread, what each flush took (ns), and
// per delivered buffer holding switch records, how long after its newest record it came (ns,
// CUPTI's clock against the switch records' own: off by up to a few ms, see slices.py).
std::thread flusher;
std::atomic<bool> flushing{false};
// One flush at a time: the flusher's and gt_stop's (not `mu`, which the delivery takes).
std::mutex flush_mu;
std::vector<uint64_t> flush_ns, late_ns;

void CUPTIAPI want_buffer(uint8_t **buf, size_t *size, size_t *max_records) {
  *size = buffer_size;
  *buf = static_cast<uint8_t *>(aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI got_buffer(CUcontext, uint32_t, uint8_t *buf, size_t, size_t valid) {
  std::lock_guard<std::mutex> g(mu);
  CUpti_Activity *r = nullptr;
  uint64_t newest = 0;
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    switch (r->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto *k = reinterpret_cast<CUpti_ActivityKernel11 *>(r);
        spans.push_back({k->start, k->end, k->correlationId, 'k'});
        kernel_ctx = k->contextId;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto *m = reinterpret_cast<CUpti_ActivityMemcpy6 *>(r);
        spans.push_back({m->start, m->end, m->correlationId, 'c'});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto *m = reinterpret_cast<CUpti_ActivityMemset4 *>(r);
        spans.push_back({m->start, m->end, m->correlationId, 's'});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        auto *a = reinterpret_cast<CUpti_ActivityAPI *>(r);
        rets.push_back({a->correlationId, a->end});
        break;
      }
      case CUPTI_ACTIVITY_KIND_COMPUTE_ENGINE_CTX_SWITCH: {
        auto *s = reinterpret_cast<CUpti_ActivityComputeEngineCtxSwitch *>(r);
        switches.push_back({s->timestamp, static_cast<uint32_t>(s->operationType), s->contextId});
        newest = std::max<uint64_t>(newest, s->timestamp);
        break;
      }
      default:
        break;
    }
  }
  if (flushing && newest) {
    uint64_t now = 0;
    cuptiGetTimestamp(&now);
    late_ns.push_back(now > newest ? now - newest : 0);
  }
  free(buf);
}

// CLOCK_REALTIME minus CUPTI's clock, read where the two reads were closest together.
int64_t clock_offset() {
  int64_t best = 0;
  uint64_t best_gap = UINT64_MAX;
  for (int i = 0; i < 16; i++) {
    timespec a{}, b{};
    uint64_t c = 0;
    clock_gettime(CLOCK_REALTIME, &a);
    cuptiGetTimestamp(&c);
    clock_gettime(CLOCK_REALTIME, &b);
    uint64_t na = a.tv_sec * 1000000000ull + a.tv_nsec, nb = b.tv_sec * 1000000000ull + b.tv_nsec;
    if (nb - na < best_gap) {
      best_gap = nb - na;
      best = static_cast<int64_t>((na + nb) / 2) - static_cast<int64_t>(c);
    }
  }
  return best;
}

}  // namespace

extern "C" int gt_start() {
  cuptiActivityRegisterCallbacks(want_buffer, got_buffer);
  for (int i = 0; i < 5; i++) enabled[i] = cuptiActivityEnable(kinds[i]);
  return enabled[0];
}

// Only the context-switch records: what a tenant reading its own slices, and nothing else,
// would pay (hack/gpu/profiler_cost.py).
extern "C" int gt_start_switches() {
  cuptiActivityRegisterCallbacks(want_buffer, got_buffer);
  enabled[4] = cuptiActivityEnable(kinds[4]);
  return enabled[4];
}

// The switch records alone, flushed every `period_us` from a thread: what a hook reading the
// slices its tenant held, to charge them, would pay. Small buffers: a forced flush hands back
// the one being filled, and a new one is taken each time.
extern "C" int gt_start_switches_every(unsigned period_us) {
  buffer_size = 64 << 10;
  cuptiActivityRegisterCallbacks(want_buffer, got_buffer);
  enabled[4] = cuptiActivityEnable(kinds[4]);
  flushing = true;
  flusher = std::thread([period_us] {
    while (flushing) {
      std::this_thread::sleep_for(std::chrono::microseconds(period_us));
      std::unique_lock<std::mutex> one(flush_mu);
      auto t0 = std::chrono::steady_clock::now();
      cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      auto dt = std::chrono::steady_clock::now() - t0;
      one.unlock();
      std::lock_guard<std::mutex> g(mu);
      flush_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count());
    }
  });
  return enabled[4];
}

// "flushes N flush_us P50 P99 MAX late_ms P50 P90 MAX records N" into `out` (up to `len`).
extern "C" int gt_flush_stats(char *out, size_t len) {
  std::lock_guard<std::mutex> g(mu);
  auto pct = [](std::vector<uint64_t> v, double q) -> double {
    if (v.empty()) return -1;
    std::sort(v.begin(), v.end());
    return static_cast<double>(v[static_cast<size_t>(q * (v.size() - 1))]);
  };
  return snprintf(out, len, "flushes %zu flush_us %.1f %.1f %.1f late_ms %.2f %.2f %.2f records %zu",
                  flush_ns.size(), pct(flush_ns, 0.5) / 1e3, pct(flush_ns, 0.99) / 1e3,
                  pct(flush_ns, 1.0) / 1e3, pct(late_ns, 0.5) / 1e6, pct(late_ns, 0.9) / 1e6,
                  pct(late_ns, 1.0) / 1e6, switches.size());
}

// Only the kernel records: what a tenant reading its own kernels' GPU time would pay.
extern "C" int gt_start_kernels() {
  cuptiActivityRegisterCallbacks(want_buffer, got_buffer);
  enabled[0] = cuptiActivityEnable(kinds[0]);
  return enabled[0];
}

// Writes the records so far to `path` and forgets them; the records stay on.
extern "C" int gt_stop(const char *path) {
  {
    std::lock_guard<std::mutex> one(flush_mu);
    cuptiActivityFlushAll(1);
  }
  int64_t offset = clock_offset();
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  std::lock_guard<std::mutex> g(mu);
  fprintf(f, "o %lld\n", static_cast<long long>(offset));
  const char *names[5] = {"kernel", "memcpy", "memset", "runtime", "ctxsw"};
  for (int i = 0; i < 5; i++) fprintf(f, "e %s %d\n", names[i], static_cast<int>(enabled[i]));
  uint32_t version = 0;
  cuptiGetVersion(&version);
  fprintf(f, "e version %u\nc %u\nd %zu\n", version, kernel_ctx, dropped);
  using ull = unsigned long long;
  for (auto &s : spans) fprintf(f, "k %llu %llu %u %c\n", (ull)s.start, (ull)s.end, s.corr, s.kind);
  for (auto &r : rets) fprintf(f, "r %u %llu\n", r.corr, (ull)r.end);
  for (auto &s : switches) fprintf(f, "s %llu %u %u\n", (ull)s.ts, s.op, s.ctx);
  spans.clear();
  rets.clear();
  switches.clear();
  return fclose(f) == 0 ? 0 : -1;
}

// Turns every record off, for a process that reads its records more than one way in turn
// (profiler_cost.py). The mix harness never calls it: its tenants stop with the records on.
extern "C" void gt_reset() {
  if (flushing.exchange(false)) flusher.join();
  buffer_size = default_buffer_size();
  for (int i = 0; i < 5; i++)
    if (enabled[i] == CUPTI_SUCCESS) cuptiActivityDisable(kinds[i]);
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> g(mu);
  spans.clear();
  rets.clear();
  switches.clear();
  flush_ns.clear();
  late_ns.clear();
  for (auto &e : enabled) e = CUPTI_ERROR_UNKNOWN;
}
