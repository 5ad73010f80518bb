//! The memory budget: every allocation is reserved with gem-schd before the driver sees it
//! (refused beyond the pod's cap), released if the driver fails, and credited when the memory
//! really goes: a free, the release of a `cuMemCreate` handle once no mapping of it remains
//! (the driver keeps a mapped handle's memory until its last `cuMemUnmap`), or the destruction
//! or reset of the context that owns it. A record per live allocation remembers what each of
//! these gives back.
//!
//! Timeouts: a memory call never waits for gem-schd longer than `KUBESHARE_HOOK_TIMEOUT_MS`.
//! When gem-schd does not answer in time (hung) or cannot be reached for that long, under
//! `KUBESHARE_ON_UNREACHABLE=wait` (fail closed) allocations are refused with
//! `CUDA_ERROR_OUT_OF_MEMORY` and memory queries report the last known cap with this process's
//! own use; under `run` the device goes unaccounted for 5 s, then retries.

use crate::clock::precise_ns;
use crate::config::{Unreachable, active, settings};
use crate::connect::{Purpose, connect, drop_client};
use crate::device::guard;
use crate::state::{Kind, MemConn, Record, gpu, lock, state};
use crate::{debug, info};
use cuda_abi::*;
use gem_proto::ClientError;
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

/// Under `KUBESHARE_ON_UNREACHABLE=run`, how long a device goes unaccounted before retrying.
const BYPASS_NS: u64 = 5_000_000_000;

/// Outcome of asking gem-schd for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    /// Not accounted (inert, unmanaged device, or `run` policy while gem-schd is away).
    Bypass,
    Denied,
    Reserved,
}

/// The memory connection, or why there is none now.
enum Conn {
    Ready(MutexGuard<'static, MemConn>),
    /// `run` policy: go unaccounted.
    Bypass,
    /// `wait` policy and gem-schd unreachable or hung: fail closed.
    Unavailable,
}

fn mem_conn(dev: usize) -> Conn {
    let g = gpu(dev);
    let mut m = lock(&g.mem);
    if precise_ns() < m.bypass_until_ns {
        return Conn::Bypass;
    }
    if m.client.is_none() {
        m.client = connect(dev, Purpose::Memory);
        match m.client.as_mut() {
            None => return unreachable(&mut m),
            Some(c) => {
                // After a reconnect (gem-schd restarted and forgot this connection), count
                // again what this process still holds.
                let held = g.outstanding.load(Ordering::Relaxed);
                if held > 0 {
                    match c.mem_alloc(held) {
                        Ok(v) if v.granted => {
                            info!("device {dev}: re-registered {held} bytes held")
                        }
                        Ok(v) => info!(
                            "device {dev}: {held} bytes held exceed the cap now ({} of {})",
                            v.used, v.limit
                        ),
                        Err(e) => info!("device {dev}: re-registering memory failed: {e}"),
                    }
                }
            }
        }
    }
    Conn::Ready(m)
}

/// gem-schd cannot be used now: what the policy says.
fn unreachable(m: &mut MemConn) -> Conn {
    match settings().on_unreachable {
        Unreachable::Run => {
            m.bypass_until_ns = precise_ns() + BYPASS_NS;
            Conn::Bypass
        }
        Unreachable::Wait => Conn::Unavailable,
    }
}

/// A failed exchange: forget the connection; `true` when one reconnect may help (gem-schd
/// restarted), `false` when it is hung (a timeout) and the caller must not wait again.
fn failed(dev: usize, m: &mut MemConn, what: &str, e: &ClientError) -> bool {
    info!("device {dev}: memory {what} failed: {e}");
    drop_client(&mut m.client, &gpu(dev).mem_fd);
    !e.is_timeout()
}

/// Reserves `bytes` on device `dev` before the driver allocates them.
pub fn mem_reserve(dev: usize, bytes: u64) -> Reserve {
    if !active() {
        return Reserve::Bypass;
    }
    for _ in 0..2 {
        let mut m = match mem_conn(dev) {
            Conn::Ready(m) => m,
            Conn::Bypass => return Reserve::Bypass,
            Conn::Unavailable => return Reserve::Denied,
        };
        let Some(c) = m.client.as_mut() else {
            continue;
        };
        match c.mem_alloc(bytes) {
            Ok(v) if v.granted => {
                gpu(dev).outstanding.fetch_add(bytes, Ordering::Relaxed);
                return Reserve::Reserved;
            }
            Ok(v) => {
                debug!(
                    "device {dev}: refused {bytes} bytes ({} of {} in use)",
                    v.used, v.limit
                );
                return Reserve::Denied;
            }
            Err(e) => {
                if !failed(dev, &mut m, "request", &e) {
                    return match unreachable(&mut m) {
                        Conn::Bypass => Reserve::Bypass,
                        _ => Reserve::Denied,
                    };
                }
            }
        }
    }
    Reserve::Denied
}

/// Credits `bytes` on device `dev` (a free, or an allocation the driver refused).
pub fn mem_credit(dev: usize, bytes: u64) {
    let g = gpu(dev);
    let _ = g
        .outstanding
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |o| {
            Some(o.saturating_sub(bytes))
        });
    let mut m = lock(&g.mem);
    if let Some(c) = m.client.as_mut()
        && let Err(e) = c.mem_free(bytes)
    {
        // The next connection re-registers what is still outstanding.
        failed(dev, &mut m, "free report", &e);
    }
}

/// The pod's (used, limit) on device `dev`, or `None` when not accounted.
pub fn mem_query(dev: usize) -> Option<(u64, u64)> {
    if !active() {
        return None;
    }
    for _ in 0..2 {
        let mut m = match mem_conn(dev) {
            Conn::Ready(m) => m,
            Conn::Bypass => return None,
            Conn::Unavailable => return last_known(dev),
        };
        let Some(c) = m.client.as_mut() else { continue };
        match c.mem_query() {
            Ok(v) => return Some(v),
            Err(e) => {
                if !failed(dev, &mut m, "query", &e) {
                    return match unreachable(&mut m) {
                        Conn::Bypass => None,
                        _ => last_known(dev),
                    };
                }
            }
        }
    }
    last_known(dev)
}

/// Without gem-schd: the cap it last announced and what this process counted.
fn last_known(dev: usize) -> Option<(u64, u64)> {
    let g = gpu(dev);
    let cap = g.cap.load(Ordering::Relaxed);
    (cap > 0).then(|| (g.outstanding.load(Ordering::Relaxed).min(cap), cap))
}

/// Is gem-schd alive? (A token wait timed out: a long wait, or a hung daemon.)
pub fn probe(dev: usize) -> bool {
    let mut m = match mem_conn(dev) {
        Conn::Ready(m) => m,
        _ => return false,
    };
    let Some(c) = m.client.as_mut() else {
        return false;
    };
    match c.mem_query() {
        Ok(_) => true,
        Err(e) => {
            failed(dev, &mut m, "liveness probe", &e);
            false
        }
    }
}

// ------------------------------------------------------------------------------ records

fn remember(kind: Kind, key: u64, r: Record) {
    lock(&state().records).insert((kind, key), r);
}

fn forget(kind: Kind, key: u64) -> Option<Record> {
    lock(&state().records).remove(&(kind, key))
}

/// The address an allocation call wrote to its out-parameter (0 for a null one).
///
/// # Safety
/// `p` is null or valid for reads of a `CUdeviceptr`.
pub(crate) unsafe fn out_ptr(p: *mut CUdeviceptr) -> u64 {
    if p.is_null() {
        0
    } else {
        // SAFETY: non-null (checked) and readable (this function's contract).
        unsafe { *p }
    }
}

/// An allocation of `bytes` on `dev`: reserve, call the driver (`call` returns its result and
/// the key of what it made), then record or roll back. `ctx` is the context that owns the
/// memory (0: none).
pub fn counted_alloc(
    dev: Option<usize>,
    bytes: u64,
    kind: Kind,
    ctx: usize,
    call: impl FnOnce() -> (CUresult, u64),
) -> CUresult {
    let Some(dev) = dev.filter(|_| active()) else {
        return call().0;
    };
    match guard(Reserve::Bypass, || mem_reserve(dev, bytes)) {
        Reserve::Bypass => call().0,
        Reserve::Denied => CUDA_ERROR_OUT_OF_MEMORY,
        Reserve::Reserved => {
            let (rc, key) = call();
            if rc == CUDA_SUCCESS {
                let r = Record {
                    dev,
                    bytes,
                    ctx,
                    maps: 0,
                    released: false,
                };
                guard((), || remember(kind, key, r));
            } else {
                guard((), || mem_credit(dev, bytes));
            }
            rc
        }
    }
}

/// A free of what `key` names: forget it first (its address may be reused at once), credit it
/// if the driver freed it, put it back if not.
pub fn counted_free(kind: Kind, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if !active() {
        return call();
    }
    let entry = guard(None, || forget(kind, key));
    let rc = call();
    if let Some(r) = entry {
        if rc == CUDA_SUCCESS {
            guard((), || mem_credit(r.dev, r.bytes));
        } else {
            guard((), || remember(kind, key, r));
        }
    }
    rc
}

/// After a pitched allocation: the driver's pitch may differ from the estimate reserved.
pub fn adjust(key: u64, dev: usize, reserved: u64, actual: u64) -> bool {
    if actual > reserved {
        if mem_reserve(dev, actual - reserved) == Reserve::Denied {
            return false;
        }
    } else if actual < reserved {
        mem_credit(dev, reserved - actual);
    }
    let mut recs = lock(&state().records);
    if let Some(r) = recs.get_mut(&(Kind::Ptr, key)) {
        r.bytes = actual;
    }
    true
}

// ------------------------------------------------------------------------------ VMM

/// `cuMemRelease`: the driver frees the memory of a released handle only when its last
/// mapping goes, so a mapped handle stays counted until then.
pub fn release_handle(h: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if !active() {
        return call();
    }
    let mapped = {
        let recs = lock(&state().records);
        recs.get(&(Kind::Handle, h)).is_some_and(|r| r.maps > 0)
    };
    if !mapped {
        return counted_free(Kind::Handle, h, call);
    }
    let rc = call();
    if rc == CUDA_SUCCESS
        && let Some(r) = lock(&state().records).get_mut(&(Kind::Handle, h))
    {
        r.released = true;
    }
    rc
}

/// After a successful `cuMemMap` of handle `h` at `va`.
pub fn mapped(va: u64, size: u64, h: u64) {
    if !active() {
        return;
    }
    let mut recs = lock(&state().records);
    if let Some(r) = recs.get_mut(&(Kind::Handle, h)) {
        r.maps += 1;
        lock(&state().maps).insert(va, (h, size));
    }
}

/// After a successful `cuMemUnmap(va, size)`: every mapping starting in the range is gone; a
/// released handle whose last mapping that was is credited.
pub fn unmapped(va: u64, size: u64) {
    if !active() {
        return;
    }
    let end = va.saturating_add(size);
    let gone: Vec<(u64, (u64, u64))> = {
        let mut maps = lock(&state().maps);
        let keys: Vec<u64> = maps.range(va..end).map(|(k, _)| *k).collect();
        keys.into_iter()
            .filter_map(|k| maps.remove(&k).map(|v| (k, v)))
            .collect()
    };
    let mut credits = vec![];
    {
        let mut recs = lock(&state().records);
        for (_, (h, _)) in gone {
            let key = (Kind::Handle, h);
            let done = match recs.get_mut(&key) {
                Some(r) => {
                    r.maps = r.maps.saturating_sub(1);
                    r.released && r.maps == 0
                }
                None => false,
            };
            if done && let Some(r) = recs.remove(&key) {
                credits.push(r);
            }
        }
    }
    for r in credits {
        mem_credit(r.dev, r.bytes);
    }
}

// ------------------------------------------------------------------------------ contexts

/// The driver freed everything context `ctx` owned (destroyed, or a primary context reset or
/// released for the last time): credit it.
pub fn credit_context(ctx: usize) {
    if ctx == 0 || !active() {
        return;
    }
    let gone: Vec<Record> = {
        let mut recs = lock(&state().records);
        let keys: Vec<(Kind, u64)> = recs
            .iter()
            .filter(|(_, r)| r.ctx == ctx)
            .map(|(k, _)| *k)
            .collect();
        keys.iter().filter_map(|k| recs.remove(k)).collect()
    };
    if !gone.is_empty() {
        let total: u64 = gone.iter().map(|r| r.bytes).sum();
        debug!(
            "context {ctx:#x} gone: crediting {} allocations, {total} bytes",
            gone.len()
        );
    }
    for r in gone {
        mem_credit(r.dev, r.bytes);
    }
}
