//! A simulated GPU: one in-order queue per device, run by a worker thread that "executes" each
//! kernel by occupying the device for the kernel's duration. Launches return at once; the
//! synchronisation calls wait on the queue's completion counter.
//!
//! The device keeps its own clock, as a GPU does: a kernel starts when it was queued or when
//! the job before it ended, whichever is later, runs for exactly its time, and an event is
//! stamped when the work before it ended. A worker thread that the host kept waiting (a
//! loaded 2-core CI machine) then catches up instead of leaving the device idle with work
//! queued or stretching event pairs over time that the busy count never saw.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// Work on a device's queue.
pub enum Job {
    /// A kernel occupying the device for this many microseconds.
    Kernel(u64),
    /// An event's record (its generation): completes the event when the work queued before it
    /// has run, unless the event was recorded again since.
    Marker(Arc<Event>, u64),
    /// Holds the queue until the registered host word at `addr` meets `value`
    /// (`CU_STREAM_WAIT_VALUE_GEQ`: `(i32)(word - value) >= 0`).
    WaitWord { addr: usize, value: u32 },
}

/// A CUDA event's state.
#[derive(Default)]
pub struct Event {
    armed: AtomicBool,
    /// Records so far: as in the driver, only the latest one's completion counts (a record
    /// still queued behind a wait must not complete a later one).
    generation: AtomicU64,
    /// When the device reached the latest record, on its clock ([`mono_ns`]).
    done: Mutex<Option<u64>>,
    cv: Condvar,
}

impl Event {
    /// Recording an event resets it until the queue reaches this record; returns the
    /// record's generation, for its [`Job::Marker`].
    pub fn arm(&self) -> u64 {
        self.armed.store(true, Ordering::Release);
        let Ok(mut d) = self.done.lock() else {
            return 0;
        };
        *d = None;
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Acquire)
    }
    /// When the device reached the latest record ([`mono_ns`]), once it has.
    pub fn done_at(&self) -> Option<u64> {
        self.done.lock().ok().and_then(|d| *d)
    }
    /// The queue reached record `generation` at `at` ([`mono_ns`]): done, if it is the latest.
    fn complete(&self, generation: u64, at: u64) {
        if let Ok(mut d) = self.done.lock()
            && self.generation.load(Ordering::Acquire) == generation
        {
            *d = Some(at);
        }
        self.cv.notify_all();
    }
    /// Waits until the queue has reached the event (at once if it was never recorded).
    pub fn wait(&self) {
        if !self.armed() {
            return;
        }
        let Ok(mut d) = self.done.lock() else { return };
        while d.is_none() {
            d = match self.cv.wait(d) {
                Ok(d) => d,
                Err(_) => return,
            };
        }
    }
}

/// `CLOCK_MONOTONIC` in ns: the devices' clock, one for every process (a shared device's lock
/// file carries the end of the last kernel run under it).
pub fn mono_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The end of the last kernel run under the shared lock `fd` ([`mono_ns`]; 0 if none yet).
fn shared_end(fd: i32) -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: reads at most 8 bytes into `b` from a descriptor this process owns.
    let n = unsafe { libc::pread(fd, b.as_mut_ptr().cast(), 8, 0) };
    if n == 8 { u64::from_le_bytes(b) } else { 0 }
}

/// Records `end` as the end of the last kernel run under the shared lock `fd`.
fn set_shared_end(fd: i32, end: u64) {
    let b = end.to_le_bytes();
    // SAFETY: writes 8 bytes from `b` to a descriptor this process owns.
    let _ = unsafe { libc::pwrite(fd, b.as_ptr().cast(), 8, 0) };
}

/// With `FAKE_CUDA_SHARED_DIR` set, the simulated devices of all processes naming that
/// directory are one device: a kernel runs only while holding an exclusive `flock` on
/// `<dir>/<uuid>.lock`, as kernels of several processes share one real GPU.
fn shared_lock(uuid: &[u8; 16]) -> Option<i32> {
    let dir = std::env::var_os("FAKE_CUDA_SHARED_DIR")?;
    let name: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    let path = std::path::Path::new(&dir).join(format!("{name}.lock"));
    let c =
        std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str())).ok()?;
    // SAFETY: open with a valid path; the descriptor lives as long as the process.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_CREAT | libc::O_RDWR | libc::O_CLOEXEC,
            0o600,
        )
    };
    (fd >= 0).then_some(fd)
}

/// The queue's last sequence number and its sender (made when the worker starts); each job
/// goes with its sequence number and when it was queued ([`mono_ns`]).
type Queue = (u64, Option<Sender<(u64, u64, Job)>>);

/// One simulated device.
pub struct Device {
    pub index: usize,
    pub uuid: [u8; 16],
    pub mem_total: u64,
    mem_used: Mutex<u64>,
    queue: Mutex<Queue>,
    completed: Mutex<u64>,
    completed_cv: Condvar,
    busy_ns: AtomicU64,
    worker: OnceLock<()>,
}

impl Device {
    pub fn new(index: usize, uuid: [u8; 16], mem_total: u64) -> Self {
        Device {
            index,
            uuid,
            mem_total,
            mem_used: Mutex::new(0),
            queue: Mutex::new((0, None)),
            completed: Mutex::new(0),
            completed_cv: Condvar::new(),
            busy_ns: AtomicU64::new(0),
            worker: OnceLock::new(),
        }
    }

    /// Queues a job; returns its sequence number (jobs complete in this order).
    pub fn submit(self: &Arc<Self>, job: Job) -> u64 {
        self.start_worker();
        let Ok(mut q) = self.queue.lock() else {
            return 0;
        };
        q.0 += 1;
        let seq = q.0;
        if let Some(tx) = &q.1 {
            let _ = tx.send((seq, mono_ns(), job));
        }
        seq
    }

    fn start_worker(self: &Arc<Self>) {
        self.worker.get_or_init(|| {
            let (tx, rx) = channel::<(u64, u64, Job)>();
            if let Ok(mut q) = self.queue.lock() {
                q.1 = Some(tx);
            }
            let dev = Arc::clone(self);
            let shared = shared_lock(&self.uuid);
            let _ = std::thread::Builder::new()
                .name(format!("fake-gpu-{}", self.index))
                .spawn(move || {
                    // When the job before ended, on the device's clock.
                    let mut prev_end = 0u64;
                    for (seq, queued, job) in rx {
                        match job {
                            Job::Kernel(us) => {
                                // Sleeping, not spinning: CI has few cores. The kernel starts
                                // when the device could have started it (not before a shared
                                // device's last kernel ended) and takes exactly its time; the
                                // worker sleeps to its end, or not at all if it is behind.
                                let mut after = 0;
                                if let Some(fd) = shared {
                                    // SAFETY: a lock file descriptor this thread owns.
                                    unsafe { libc::flock(fd, libc::LOCK_EX) };
                                    after = shared_end(fd);
                                }
                                let start = queued.max(prev_end).max(after);
                                let end = start + us * 1000;
                                let left = end.saturating_sub(mono_ns());
                                if left > 0 {
                                    std::thread::sleep(Duration::from_nanos(left));
                                }
                                if let Some(fd) = shared {
                                    set_shared_end(fd, end);
                                    // SAFETY: as above.
                                    unsafe { libc::flock(fd, libc::LOCK_UN) };
                                }
                                prev_end = end;
                                dev.busy_ns.fetch_add(us * 1000, Ordering::Relaxed);
                            }
                            Job::Marker(ev, generation) => {
                                prev_end = prev_end.max(queued);
                                ev.complete(generation, prev_end);
                            }
                            Job::WaitWord { addr, value } => {
                                // SAFETY: `cuStreamWaitValue32_v2` queues only aligned
                                // addresses in registered ranges, which their owner keeps
                                // mapped (the driver's contract for registered memory).
                                let word = unsafe { &*(addr as *const AtomicU32) };
                                let open = || {
                                    (word.load(Ordering::Acquire).wrapping_sub(value) as i32) >= 0
                                };
                                if open() {
                                    prev_end = prev_end.max(queued);
                                } else {
                                    while !open() {
                                        std::thread::sleep(Duration::from_micros(20));
                                    }
                                    // The device waited, idle, until it saw the word.
                                    prev_end = mono_ns();
                                }
                            }
                        }
                        if let Ok(mut c) = dev.completed.lock() {
                            *c = seq;
                        }
                        dev.completed_cv.notify_all();
                    }
                });
        });
    }

    pub fn submitted(&self) -> u64 {
        self.queue.lock().map(|q| q.0).unwrap_or(0)
    }

    pub fn completed(&self) -> u64 {
        self.completed.lock().map(|c| *c).unwrap_or(0)
    }

    /// Blocks until job `seq` (and everything before it) has run.
    pub fn wait_for(&self, seq: u64) {
        let Ok(mut c) = self.completed.lock() else {
            return;
        };
        while *c < seq {
            c = match self.completed_cv.wait(c) {
                Ok(c) => c,
                Err(_) => return,
            };
        }
    }

    pub fn busy_us(&self) -> u64 {
        self.busy_ns.load(Ordering::Relaxed) / 1000
    }

    pub fn reserve(&self, bytes: u64) -> bool {
        let Ok(mut u) = self.mem_used.lock() else {
            return false;
        };
        match u.checked_add(bytes) {
            Some(n) if n <= self.mem_total => {
                *u = n;
                true
            }
            _ => false,
        }
    }

    pub fn unreserve(&self, bytes: u64) {
        if let Ok(mut u) = self.mem_used.lock() {
            *u = u.saturating_sub(bytes);
        }
    }

    pub fn mem_used(&self) -> u64 {
        self.mem_used.lock().map(|u| *u).unwrap_or(0)
    }
}
