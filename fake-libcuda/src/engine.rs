//! A simulated GPU: one in-order queue per device, run by a worker thread that "executes" each
//! kernel by occupying the device for the kernel's duration. Launches return at once; the
//! synchronisation calls wait on the queue's completion counter.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

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
    done: Mutex<Option<Instant>>,
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
    pub fn done_at(&self) -> Option<Instant> {
        self.done.lock().ok().and_then(|d| *d)
    }
    /// The queue reached record `generation`: done, if it is the latest.
    fn complete(&self, generation: u64) {
        if let Ok(mut d) = self.done.lock()
            && self.generation.load(Ordering::Acquire) == generation
        {
            *d = Some(Instant::now());
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

/// The queue's last sequence number and its sender (made when the worker starts).
type Queue = (u64, Option<Sender<(u64, Job)>>);

/// One simulated device.
pub struct Device {
    pub index: usize,
    pub uuid: [u8; 16],
    pub mem_total: u64,
    mem_used: Mutex<u64>,
    queue: Mutex<Queue>,
    completed: Mutex<u64>,
    completed_cv: Condvar,
    busy_us: AtomicU64,
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
            busy_us: AtomicU64::new(0),
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
            let _ = tx.send((seq, job));
        }
        seq
    }

    fn start_worker(self: &Arc<Self>) {
        self.worker.get_or_init(|| {
            let (tx, rx) = channel::<(u64, Job)>();
            if let Ok(mut q) = self.queue.lock() {
                q.1 = Some(tx);
            }
            let dev = Arc::clone(self);
            let shared = shared_lock(&self.uuid);
            let _ = std::thread::Builder::new()
                .name(format!("fake-gpu-{}", self.index))
                .spawn(move || {
                    for (seq, job) in rx {
                        match job {
                            Job::Kernel(us) => {
                                // Sleeping, not spinning: CI has few cores. The time
                                // counted is the time the device was really occupied.
                                if let Some(fd) = shared {
                                    // SAFETY: a lock file descriptor this thread owns.
                                    unsafe { libc::flock(fd, libc::LOCK_EX) };
                                }
                                let t0 = Instant::now();
                                std::thread::sleep(Duration::from_micros(us));
                                if let Some(fd) = shared {
                                    // SAFETY: as above.
                                    unsafe { libc::flock(fd, libc::LOCK_UN) };
                                }
                                dev.busy_us
                                    .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                            }
                            Job::Marker(ev, generation) => ev.complete(generation),
                            Job::WaitWord { addr, value } => {
                                // SAFETY: `cuStreamWaitValue32_v2` queues only aligned
                                // addresses in registered ranges, which their owner keeps
                                // mapped (the driver's contract for registered memory).
                                let word = unsafe { &*(addr as *const AtomicU32) };
                                while (word.load(Ordering::Acquire).wrapping_sub(value) as i32) < 0
                                {
                                    std::thread::sleep(Duration::from_micros(20));
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
        self.busy_us.load(Ordering::Relaxed)
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
