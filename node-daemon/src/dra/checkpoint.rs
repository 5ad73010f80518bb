//! The kubelet plugin's checkpoint: the claims prepared on this node, kept in
//! `<root>/dra/checkpoint.json`, so that a restarted daemon keeps them in gem-schd's
//! books (the kubelet does not prepare a claim again while its pod runs).
//!
//! Written atomically (temporary file, fsync, rename): a crash leaves the old file or
//! the new one. A checksum over the claims catches a file changed by hand or on disk.
//! A corrupt or unreadable checkpoint is an error, never read as "no claims": the
//! daemon would then drop running pods' shares from the books. It is left in place for
//! the operator to look at.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::claim::PreparedClaim;

/// The format version written.
pub const VERSION: u32 = 1;
/// The file name, in `<root>/dra/`.
pub const FILE: &str = "checkpoint.json";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read the DRA checkpoint {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error(
        "the DRA checkpoint {path} is corrupt ({why}); it is left as it is, as the claims it lists may be in use: move it aside to start without them (their pods then run unenforced until they restart)"
    )]
    Corrupt { path: PathBuf, why: String },
    #[error("cannot write the DRA checkpoint {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    checksum: String,
    claims: Vec<PreparedClaim>,
}

/// FNV-1a, 64 bits: enough to tell a changed file, with no dependency.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn checksum(claims: &[PreparedClaim]) -> String {
    let bytes = serde_json::to_vec(claims).unwrap_or_default();
    format!("fnv1a64:{:016x}", fnv1a(&bytes))
}

/// The file's bytes for `claims` (by claim UID).
pub fn encode(claims: &BTreeMap<String, PreparedClaim>) -> Vec<u8> {
    let claims: Vec<PreparedClaim> = claims.values().cloned().collect();
    let file = File {
        version: VERSION,
        checksum: checksum(&claims),
        claims,
    };
    let mut out = serde_json::to_vec_pretty(&file).unwrap_or_default();
    out.push(b'\n');
    out
}

/// The claims in a checkpoint's bytes; `Err` says what is wrong with them.
pub fn decode(bytes: &[u8]) -> Result<BTreeMap<String, PreparedClaim>, String> {
    let file: File = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if file.version != VERSION {
        return Err(format!(
            "version {} (this daemon reads {VERSION})",
            file.version
        ));
    }
    let sum = checksum(&file.claims);
    if sum != file.checksum {
        return Err(format!(
            "checksum {} does not match the claims ({sum})",
            file.checksum
        ));
    }
    let mut out = BTreeMap::new();
    for c in file.claims {
        if out.insert(c.uid.clone(), c).is_some() {
            return Err("a claim is listed twice".into());
        }
    }
    Ok(out)
}

/// The checkpoint at `path`; no file is no claims.
pub fn load(path: &Path) -> Result<BTreeMap<String, PreparedClaim>, CheckpointError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(source) => {
            return Err(CheckpointError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    decode(&bytes).map_err(|why| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        why,
    })
}

/// Replaces the checkpoint at `path` with `claims`, atomically.
pub fn store(path: &Path, claims: &BTreeMap<String, PreparedClaim>) -> Result<(), CheckpointError> {
    let werr = |source| CheckpointError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(werr)?;
    }
    crate::disk::write_atomic(path, &encode(claims)).map_err(werr)
}

#[cfg(test)]
mod tests {
    use super::super::claim::{ClaimDevice, ClaimPod, PreparedClaim};
    use super::*;

    fn claim(uid: &str, um: bool) -> PreparedClaim {
        PreparedClaim {
            uid: uid.into(),
            namespace: "ns".into(),
            name: format!("c-{uid}"),
            pod_uid: "8d9e5c3a-1b2c-4d5e-8f90-0123456789ab".into(),
            pod_name: "p".into(),
            devices: vec![ClaimDevice {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-0".into(),
                share_id: um.then(|| "s-1".to_string()),
                gpu_uuid: "GPU-00000000-0000-4000-8000-000000000000".into(),
                gpu_index: 0,
                request_milli: 300,
                limit_milli: 600,
                memory_cap: if um { 4 << 30 } else { 2 << 30 },
                um_resident: um.then_some(2 << 30),
                priority: um.then_some(0),
            }],
            whole: false,
            client: if um { "claim-u2".into() } else { String::new() },
            pods: if um {
                vec![
                    ClaimPod {
                        uid: "8d9e5c3a-1b2c-4d5e-8f90-0123456789ab".into(),
                        name: "p".into(),
                    },
                    ClaimPod {
                        uid: "9d9e5c3a-1b2c-4d5e-8f90-0123456789ab".into(),
                        name: "q".into(),
                    },
                ]
            } else {
                vec![]
            },
        }
    }

    fn two() -> BTreeMap<String, PreparedClaim> {
        [claim("u1", false), claim("u2", true)]
            .into_iter()
            .map(|c| (c.uid.clone(), c))
            .collect()
    }

    #[test]
    fn round_trip_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dra").join(FILE);
        assert!(load(&path).unwrap().is_empty(), "no file: no claims");
        store(&path, &two()).unwrap();
        assert_eq!(load(&path).unwrap(), two());
        let mut one = two();
        one.remove("u1");
        store(&path, &one).unwrap();
        assert_eq!(load(&path).unwrap(), one);
        // Only the checkpoint in the directory: no temporary file left behind.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, [FILE]);
    }

    #[test]
    fn a_corrupt_checkpoint_is_an_error_and_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let good = encode(&two());
        let text = String::from_utf8(good.clone()).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..good.len() / 2].to_vec(), "EOF while parsing"),
            (
                text.replace("\"limitMilli\": 600", "\"limitMilli\": 1000")
                    .into_bytes(),
                "does not match the claims",
            ),
            (
                text.replacen("\"version\": 1", "\"version\": 9", 1)
                    .into_bytes(),
                "version 9 (this daemon reads 1)",
            ),
            (b"".to_vec(), "EOF while parsing"),
        ];
        for (bytes, why) in cases {
            std::fs::write(&path, &bytes).unwrap();
            let e = load(&path).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, CheckpointError::Corrupt { .. }), "{msg}");
            assert!(msg.contains(why), "{msg}");
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains("move it aside"), "{msg}");
            assert_eq!(
                std::fs::read(&path).unwrap(),
                bytes,
                "the file is untouched"
            );
        }
        // Formatting alone (what a person's editor might change) is not corruption.
        std::fs::write(&path, text.replace("  ", "    ")).unwrap();
        assert_eq!(load(&path).unwrap(), two());
    }
}
