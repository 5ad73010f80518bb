//! The gate page: one word per token connection, shared by gem-schd and the client, that
//! gem-schd sets before each Grant it sends on that connection.
//!
//! A client told Soon queues its next turn's work ahead, each stream behind a stream-ordered
//! wait on this word; the GPU then starts that work when gem-schd sets the word at the Grant,
//! without waiting for the client's thread to wake up, read the Grant and launch (measured on
//! an H200 with two processes: 0.23 ms from one turn's last kernel to the next turn's first
//! when the next process is woken on the host, 0.147 ms when its work waits on such a word;
//! `hack/gpu/handover_wait.cu`). gem-schd makes the page (a memfd of one page, sealed against
//! resizing, so that neither side can make the other's mapping fault) and passes its
//! descriptor with the Gate reply as `SCM_RIGHTS` ancillary data ([`send_with_fd`],
//! [`recv_with_fd`]). The word is 0 while the client waits and 1 once granted: the client
//! clears it before each TokenRequest and also sets it itself when it reads a Grant, so a
//! gem-schd that never sets it (or dies) delays the client's queued work, never holds it.
//! Beside the word, at byte 8, gem-schd stores the grant's time (`CLOCK_MONOTONIC`, ns) before
//! it sets the word: work queued behind the word runs from then, however late the client
//! reads the Grant, so the client counts its hold (and the overuse it reports) from then.
//! At byte 16 it stores whether other clients' work may run on the GPU during that hold
//! (co-running): a client parks its queue at a hold's end only where none does. At byte 20,
//! whether the token is expected to go to another client when that hold ends: a client keeps
//! its queue short toward such a hold's end, and may let it grow in a renewed hold that is
//! expected to be renewed again.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A mapped gate page.
#[derive(Debug)]
pub struct GatePage {
    word: NonNull<AtomicU32>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is shared memory owned by this value until it drops; the word is only
// accessed through `AtomicU32`, which is safe to share between threads.
unsafe impl Send for GatePage {}
// SAFETY: as above; `&GatePage` only loads and stores the atomic word.
unsafe impl Sync for GatePage {}

/// The seals a gate page carries: neither side can shrink it under the other's mapping.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

fn page_len() -> usize {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n)
        .ok()
        .filter(|n| *n >= 4096)
        .unwrap_or(4096)
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

impl GatePage {
    /// A new page, its word 0 (gem-schd's side).
    pub fn create() -> io::Result<GatePage> {
        // SAFETY: the name is a NUL-terminated literal; the flags are memfd_create's.
        let fd = check(unsafe {
            libc::memfd_create(
                c"gem-gate".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        })?;
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = page_len();
        // SAFETY: plain calls on the descriptor owned above.
        check(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        // SAFETY: as above.
        check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) })?;
        GatePage::map(fd, len)
    }

    /// Maps a page received from gem-schd (the client's side). Refused unless it is a sealed
    /// memfd of at least one page: a file that could shrink would make the mapping fault.
    pub fn from_fd(fd: OwnedFd) -> io::Result<GatePage> {
        // SAFETY: a plain fcntl on a descriptor this function owns.
        let seals = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the gate page is not sealed against shrinking",
            ));
        }
        // SAFETY: `st` is a plain C struct that fstat fills; the descriptor is owned here.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
        let len = page_len();
        if usize::try_from(st.st_size).unwrap_or(0) < len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the gate page has {} bytes, less than a page", st.st_size),
            ));
        }
        GatePage::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<GatePage> {
        // SAFETY: a new shared mapping of `len` bytes of a file at least that long (created so,
        // or checked and sealed against shrinking); the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let word = NonNull::new(p.cast::<AtomicU32>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(GatePage { word, len, fd })
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: the mapping is live and page-aligned (so aligned for u32) while `self` is.
        unsafe { self.word.as_ref() }
    }

    fn stamp(&self) -> &AtomicU64 {
        // SAFETY: byte 8 of a live, page-aligned mapping of at least a page: in bounds and
        // aligned for u64; only accessed through the atomic.
        unsafe { &*self.word.as_ptr().cast::<u8>().add(8).cast::<AtomicU64>() }
    }

    /// Lets the work queued behind the word run (a Grant).
    pub fn open(&self) {
        self.word().store(1, Ordering::Release);
    }

    fn shared_word(&self) -> &AtomicU32 {
        // SAFETY: byte 16 of a live, page-aligned mapping of at least a page: in bounds and
        // aligned for u32; only accessed through the atomic.
        unsafe { &*self.word.as_ptr().cast::<u8>().add(16).cast::<AtomicU32>() }
    }

    fn handover_due_word(&self) -> &AtomicU32 {
        // SAFETY: byte 20 of a live, page-aligned mapping of at least a page: in bounds and
        // aligned for u32; only accessed through the atomic.
        unsafe { &*self.word.as_ptr().cast::<u8>().add(20).cast::<AtomicU32>() }
    }

    /// [`GatePage::open`] for a Grant made at `at_ns` (`CLOCK_MONOTONIC`), whether other
    /// clients' work may run on the GPU during that hold (`shared`) and whether the token is
    /// expected to go to another client when it ends (`handover_due`), all stored first.
    pub fn open_at(&self, at_ns: u64, shared: bool, handover_due: bool) {
        self.stamp().store(at_ns, Ordering::Relaxed);
        self.set_shared(shared);
        self.handover_due_word()
            .store(u32::from(handover_due), Ordering::Relaxed);
        self.open();
    }

    /// Whether the token is expected to go to another client when the hold gem-schd last
    /// opened the word for ends (false from a gem-schd that does not say: it renews a hold
    /// only while nobody waits).
    pub fn handover_due(&self) -> bool {
        self.handover_due_word().load(Ordering::Relaxed) != 0
    }

    /// Says again whether other clients' work may run during the hold (a limit that changed
    /// during it changes that); read by the client at the hold's end.
    pub fn set_shared(&self, shared: bool) {
        self.shared_word()
            .store(u32::from(shared), Ordering::Relaxed);
    }

    /// Whether gem-schd said, at the Grant it last opened the word for, that other clients'
    /// work may run on the GPU during that hold (false from a gem-schd that does not say).
    pub fn shared(&self) -> bool {
        self.shared_word().load(Ordering::Relaxed) != 0
    }

    /// When gem-schd last opened the word for a Grant ([`GatePage::open_at`]; 0: never).
    pub fn opened_at(&self) -> u64 {
        self.stamp().load(Ordering::Relaxed)
    }

    /// Holds back work queued behind the word from now on (before a TokenRequest).
    pub fn close(&self) {
        self.word().store(0, Ordering::Release);
    }

    pub fn is_open(&self) -> bool {
        self.word().load(Ordering::Acquire) != 0
    }

    /// The word's address (page-aligned), to register with the driver and wait on.
    pub fn addr(&self) -> *mut u32 {
        self.word.as_ptr().cast()
    }

    /// The page's length in bytes (one page).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty; for the `len` convention.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Opens the word for good and leaves the page mapped (its descriptor closed): a client
    /// that drops its connection may have work queued behind the word, which the driver
    /// still reads, so that work must run and the memory must stay. A page per lost
    /// connection.
    pub fn release(self) {
        self.open();
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so the descriptor is read out exactly once and
        // closed here; the mapping is deliberately kept.
        drop(unsafe { std::ptr::read(&me.fd) });
    }

    /// The page's descriptor, to pass to the client.
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }
}

impl Drop for GatePage {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; nothing borrows it past `self`.
        unsafe {
            libc::munmap(self.word.as_ptr().cast(), self.len);
        }
    }
}

/// Space for one descriptor's control message.
const CMSG_BUF: usize = 64;

/// `CLOCK_MONOTONIC` in ns, the clock of [`GatePage::open_at`].
pub fn monotonic_ns() -> u64 {
    // SAFETY: `ts` is a plain C struct that clock_gettime fills.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and a pointer to the live local above.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// A `msghdr` over one data buffer and the first `control_len` bytes of `control`; it points
/// at both, so they must outlive its use.
fn one_buffer_msghdr(
    iov: &mut libc::iovec,
    control: &mut [u8; CMSG_BUF],
    control_len: usize,
) -> libc::msghdr {
    // SAFETY: msghdr is a plain C struct for which all zeroes is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control_len.min(CMSG_BUF) as _;
    msg
}

/// Sends `data` with `fd` attached (`SCM_RIGHTS`), `MSG_NOSIGNAL`; returns the bytes sent (the
/// descriptor goes with the first byte, so a short send still delivered it).
pub fn send_with_fd(sock: RawFd, data: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = [0u8; CMSG_BUF];
    // SAFETY: CMSG_SPACE computes a size from a constant.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let msg = one_buffer_msghdr(&mut iov, &mut control, space);
    // SAFETY: msg_control points at `control`, which is large enough for one header and one
    // descriptor (CMSG_SPACE above ≤ CMSG_BUF), so the first header is in bounds.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` describes live buffers; the socket descriptor is the caller's.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Receives into `buf`, and the first descriptor that came with it, if any (others are
/// closed). `Ok((0, _))`: the peer closed.
pub fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u8; CMSG_BUF];
    let mut msg = one_buffer_msghdr(&mut iov, &mut control, CMSG_BUF);
    // SAFETY: `msg` describes live buffers; the socket descriptor is the caller's.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut got = None;
    // SAFETY: the kernel filled `control` up to msg_controllen; CMSG_FIRSTHDR/NXTHDR stay
    // within it and return null past its end, and each SCM_RIGHTS payload is whole
    // descriptors (a truncated one sets MSG_CTRUNC, and the kernel then closes what did not fit).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes =
                    ((*c).cmsg_len as usize).saturating_sub(data.offset_from(c.cast()) as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    let owned = OwnedFd::from_raw_fd(fd);
                    if got.is_none() {
                        got = Some(owned);
                    } // else dropped: closed
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, got))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_page_passed_over_a_socket_shares_its_word() {
        let mine = GatePage::create().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(send_with_fd(a.as_raw_fd(), b"x", mine.fd()).unwrap(), 1);
        let mut buf = [0u8; 8];
        let (n, fd) = recv_with_fd(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"x");
        let theirs = GatePage::from_fd(fd.expect("a descriptor came with the byte")).unwrap();
        assert!(!theirs.is_open());
        assert!(
            !theirs.shared(),
            "a page says nothing of sharing before a Grant"
        );
        assert!(!theirs.handover_due());
        mine.open_at(42, true, false);
        assert!(theirs.is_open());
        assert_eq!(
            (theirs.opened_at(), theirs.shared(), theirs.handover_due()),
            (42, true, false)
        );
        theirs.close();
        assert!(!mine.is_open());
        mine.open_at(43, false, true);
        assert_eq!(
            (theirs.opened_at(), theirs.shared(), theirs.handover_due()),
            (43, false, true)
        );
    }

    #[test]
    fn bytes_without_a_descriptor_bring_none() {
        let (a, b) = UnixStream::pair().unwrap();
        use std::io::Write;
        (&a).write_all(b"yz").unwrap();
        let mut buf = [0u8; 8];
        let (n, fd) = recv_with_fd(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, fd.is_none()), (2, true));
    }

    #[test]
    fn an_unsealed_or_short_file_is_refused() {
        let f = tempfile_fd(4096, false);
        let e = GatePage::from_fd(f).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        let f = tempfile_fd(16, true);
        let e = GatePage::from_fd(f).unwrap_err();
        assert!(e.to_string().contains("less than a page"), "{e}");
    }

    /// A memfd of `len` bytes, sealed against shrinking or not.
    fn tempfile_fd(len: usize, sealed: bool) -> OwnedFd {
        // SAFETY: as in `GatePage::create`.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on the descriptor owned above.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            if sealed {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS), 0);
            }
        }
        fd
    }
}
