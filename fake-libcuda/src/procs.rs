//! Which processes have a context on each simulated GPU, for NVML's
//! `nvmlDeviceGetComputeRunningProcesses_v3` (the node daemon's check of GPU use that
//! gem-schd does not gate).
//!
//! With `FAKE_CUDA_SHARED_DIR` set, a process that makes a context on a device (primary or
//! not) records itself once in `<dir>/procs/<uuid-hex>/<pid>-<nanos>`: a file it holds an
//! `flock` on for as long as it lives (the descriptor is never closed). NVML lists a device's
//! processes from the locks on those files in `/proc/locks`, which numbers each locker in the
//! reader's PID namespace, as the real driver's NVML reports PIDs: a node daemon sharing the
//! host's PID namespace sees the host PIDs of processes in pods. Files nobody holds (their
//! process is gone) are removed as they are found. Without the variable, no process is
//! listed. `FAKE_CUDA_INVENTORY` gives a node daemon in fake mode the GPUs of its inventory.

use std::collections::HashSet;
use std::ffi::{CString, c_uint};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::driver;
use cuda_abi::nvml::{
    NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT, NVML_SUCCESS, NvmlDevice, NvmlReturn,
};
/// NVML's "not available" for a 64-bit value, and a GPU/compute instance ID outside MIG.
const NOT_AVAILABLE_U64: u64 = u64::MAX;
const NO_INSTANCE: u32 = u32::MAX;

/// `nvmlProcessInfo_t` as `nvmlDeviceGetComputeRunningProcesses_v3` fills it
/// (`nvmlProcessInfo_v2_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

fn uuid_hex(uuid: &[u8; 16]) -> String {
    uuid.iter().map(|b| format!("{b:02x}")).collect()
}

fn device_dir(uuid: &[u8; 16]) -> Option<PathBuf> {
    let dir = std::env::var_os("FAKE_CUDA_SHARED_DIR")?;
    Some(Path::new(&dir).join("procs").join(uuid_hex(uuid)))
}

/// (pid, device) pairs recorded by this process image; a forked child has another pid and
/// records itself anew.
static RECORDED: Mutex<Option<HashSet<(u32, usize)>>> = Mutex::new(None);

/// Records the calling process as having a context on device `dev` (once).
pub(crate) fn record(dev: usize) {
    let Some(d) = driver().devices.get(dev) else {
        return;
    };
    let pid = std::process::id();
    {
        let Ok(mut r) = RECORDED.lock() else { return };
        if !r.get_or_insert_with(HashSet::new).insert((pid, dev)) {
            return;
        }
    }
    let Some(dir) = device_dir(&d.uuid) else {
        return;
    };
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.as_nanos());
    let name = format!("{pid}-{nanos}");
    // Locked under a hidden name, then renamed into place: a reader never sees it unlocked.
    let tmp = dir.join(format!(".{name}"));
    let Ok(c) = CString::new(tmp.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: open with a valid NUL-terminated path; the descriptor is kept (leaked) so the
    // lock lasts as long as the process.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_CREAT | libc::O_RDWR | libc::O_CLOEXEC,
            0o644,
        )
    };
    if fd < 0 {
        return;
    }
    // SAFETY: flock on the descriptor just opened.
    if unsafe { libc::flock(fd, libc::LOCK_SH) } != 0 {
        // SAFETY: closing our own descriptor.
        unsafe { libc::close(fd) };
        let _ = std::fs::remove_file(&tmp);
        return;
    }
    let _ = std::fs::rename(&tmp, dir.join(name));
}

/// The flock holders in the text of `/proc/locks`: (major, minor, inode) -> pid.
fn flock_holders(locks: &str) -> Vec<((u32, u32, u64), u32)> {
    locks
        .lines()
        .filter(|l| !l.contains("->")) // a waiter, not a holder
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.get(1) != Some(&"FLOCK") {
                return None;
            }
            let pid: u32 = f.get(4)?.parse().ok()?;
            let mut id = f.get(5)?.split(':');
            let maj = u32::from_str_radix(id.next()?, 16).ok()?;
            let min = u32::from_str_radix(id.next()?, 16).ok()?;
            let ino: u64 = id.next()?.parse().ok()?;
            Some(((maj, min, ino), pid))
        })
        .collect()
}

/// The PIDs holding the records of the device with `uuid`; removes records nobody holds.
fn holders(uuid: &[u8; 16]) -> Vec<u32> {
    let Some(dir) = device_dir(uuid) else {
        return vec![];
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return vec![];
    };
    let locks = flock_holders(&std::fs::read_to_string("/proc/locks").unwrap_or_default());
    let mut pids = vec![];
    for e in entries.flatten() {
        if e.file_name().as_bytes().starts_with(b".") {
            continue;
        }
        let Ok(m) = e.metadata() else { continue };
        let id = (libc::major(m.dev()), libc::minor(m.dev()), m.ino());
        let held: Vec<u32> = locks
            .iter()
            .filter(|(k, _)| *k == id)
            .map(|(_, p)| *p)
            .collect();
        if held.is_empty() {
            remove_if_unheld(&e.path());
        }
        pids.extend(held.into_iter().filter(|p| *p > 0));
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Removes a record whose process is gone (checked by taking its lock ourselves).
fn remove_if_unheld(path: &Path) {
    let Ok(f) = std::fs::File::open(path) else {
        return;
    };
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; it is released when `f` drops.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        let _ = std::fs::remove_file(path);
    }
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`: with room for fewer than there are (or no
/// array), the count and NVML_ERROR_INSUFFICIENT_SIZE; none at all is a success.
///
/// # Safety
/// NVML's contract: `count` is null or valid for reads and writes of a `c_uint`, and `infos`
/// is null or valid for writes of `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    h: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // A handle is the device's index + 1 (see nvml.rs).
    let Some(d) = (h as usize)
        .checked_sub(1)
        .and_then(|i| driver().devices.get(i))
    else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let pids = holders(&d.uuid);
    // SAFETY: `count` is non-null and the caller's.
    let room = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { count.write(pids.len() as c_uint) };
    if pids.is_empty() {
        return NVML_SUCCESS;
    }
    if infos.is_null() || room < pids.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (i, pid) in pids.iter().enumerate() {
        // SAFETY: the caller's array has room for `room` >= pids.len() entries.
        unsafe {
            infos.add(i).write(NvmlProcessInfo {
                pid: *pid,
                used_gpu_memory: NOT_AVAILABLE_U64,
                gpu_instance_id: NO_INSTANCE,
                compute_instance_id: NO_INSTANCE,
            })
        };
    }
    NVML_SUCCESS
}

/// The UUIDs of the GPUs in the node inventory file `FAKE_CUDA_INVENTORY` names (the node
/// daemon's `--fake-inventory`), as `FAKE_CUDA_DEVICES` lists them: a node daemon in fake mode
/// loads this library as NVML and sees the GPUs it publishes.
pub(crate) fn devices_from_inventory() -> Option<String> {
    let path = std::env::var_os("FAKE_CUDA_INVENTORY")?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let uuids: Vec<&str> = v["gpus"]
        .as_array()?
        .iter()
        .filter_map(|g| g["uuid"].as_str())
        .collect();
    Some(uuids.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_flock_holders_from_proc_locks() {
        let text = "1: FLOCK  ADVISORY  WRITE 4242 00:2b:1234 0 EOF\n\
                    2: POSIX  ADVISORY  WRITE 77 00:2b:1234 0 EOF\n\
                    3: FLOCK  ADVISORY  READ  99 fd:01:555 0 EOF\n\
                    3: -> FLOCK  ADVISORY  WRITE 100 fd:01:555 0 EOF\n";
        assert_eq!(
            flock_holders(text),
            vec![((0, 0x2b, 1234), 4242), ((0xfd, 1, 555), 99)]
        );
    }
}
