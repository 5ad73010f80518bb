//! Gemini's per-GPU resource-config file: who shares a GPU, and how much.
//!
//! ```text
//! 2
//! 6f1c…-pod-uid-a 0.3 0.5 4294967296
//! 9b2e…-pod-uid-b 0.5 1.0 8589934592 opportunistic
//! ```
//! The first line is the number N of entries, then N lines `ID REQUEST LIMIT GPU_MEM [CLASS]`,
//! in Gemini's order (request before limit; KubeShare 2.0 swapped them). `CLASS` is
//! `guaranteed` or `opportunistic` (see [`ClientClass`]); a line without it is guaranteed, so
//! Gemini's four-column files keep their meaning, and [`ResourceConfig::render`] writes the
//! column only for opportunistic clients. The node daemon writes it, gem-schd reads it.
//! `parse(render(c)) == c` exactly.

use std::collections::HashSet;
use std::fmt::Write as _;

use crate::milli::Milli;

/// How gem-schd treats a client's request (the pod's `sharedgpu/priority`: 0 is
/// opportunistic, 1–100 guaranteed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum ClientClass {
    /// Gets what the turns leave it after the guaranteed clients, who go first whenever they
    /// wait; among opportunistic clients, requests and limits apply as among guaranteed ones.
    Opportunistic,
    /// Its request is a guarantee. The default: a line without a class (Gemini's format).
    #[default]
    Guaranteed,
}

impl ClientClass {
    /// The word in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientClass::Guaranteed => "guaranteed",
            ClientClass::Opportunistic => "opportunistic",
        }
    }

    /// The class of a pod of `sharedgpu/priority` `priority`.
    pub fn of_priority(priority: u8) -> ClientClass {
        if priority == 0 {
            ClientClass::Opportunistic
        } else {
            ClientClass::Guaranteed
        }
    }
}

impl std::fmt::Display for ClientClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ClientClass {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "guaranteed" => Ok(ClientClass::Guaranteed),
            "opportunistic" => Ok(ClientClass::Opportunistic),
            _ => Err(format!(
                "{s:?} is not a class (guaranteed or opportunistic)"
            )),
        }
    }
}

/// One client sharing the GPU.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResourceEntry {
    /// The client's ID (the pod UID in Kubernetes): no whitespace.
    pub id: String,
    pub request: Milli,
    pub limit: Milli,
    /// Memory cap in bytes.
    pub gpu_mem: u64,
    pub class: ClientClass,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResourceConfig {
    pub entries: Vec<ResourceEntry>,
}

/// A malformed file; `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceConfigError {
    #[error("line 1: the file is empty; the first line must be the number of entries")]
    Empty,
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("the file declares {declared} entries on line 1 but has only {found}")]
    TooFew { declared: usize, found: usize },
}

/// Longest client ID accepted (a pod UID is 36; bare-metal names are free-form).
pub const MAX_ID_LEN: usize = 253;

/// Whether `id` can stand as a client ID in the file and in a socket path.
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'\\')
}

impl ResourceConfig {
    pub fn parse(text: &str) -> Result<ResourceConfig, ResourceConfigError> {
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
        let (_, first) = lines
            .by_ref()
            .find(|(_, l)| !l.is_empty())
            .ok_or(ResourceConfigError::Empty)?;
        let err = |line: usize, message: String| ResourceConfigError::Line { line, message };
        let declared: usize = first
            .parse()
            .ok()
            .filter(|n| *n <= 100_000)
            .ok_or_else(|| err(1, format!("{first:?} is not the number of entries")))?;
        let mut entries = Vec::with_capacity(declared.min(1024));
        let mut seen = HashSet::new();
        for (no, line) in lines {
            if line.is_empty() {
                continue;
            }
            if entries.len() == declared {
                return Err(err(
                    no,
                    format!("line 1 declares {declared} entries but more lines follow"),
                ));
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (id, req, lim, mem, class) = match fields[..] {
                [id, req, lim, mem] => (id, req, lim, mem, None),
                [id, req, lim, mem, class] => (id, req, lim, mem, Some(class)),
                _ => {
                    return Err(err(
                        no,
                        format!(
                            "expected 4 or 5 fields `ID REQUEST LIMIT GPU_MEM [CLASS]`, found {}",
                            fields.len()
                        ),
                    ));
                }
            };
            if !is_valid_id(id) {
                return Err(err(no, format!("{id:?} is not a valid client ID")));
            }
            let request = Milli::parse(req)
                .map_err(|e| err(no, format!("REQUEST {req:?}: {e} (a share from 0 to 1.0)")))?;
            let limit = Milli::parse(lim)
                .map_err(|e| err(no, format!("LIMIT {lim:?}: {e} (a share from 0 to 1.0)")))?;
            if request > limit {
                return Err(err(
                    no,
                    format!(
                        "REQUEST {req} is above LIMIT {lim} (Gemini's order is ID REQUEST LIMIT GPU_MEM)"
                    ),
                ));
            }
            let gpu_mem: u64 = mem
                .parse()
                .map_err(|_| err(no, format!("GPU_MEM {mem:?} is not a byte count")))?;
            let class = match class {
                None => ClientClass::default(),
                Some(c) => c.parse().map_err(|e| err(no, format!("CLASS: {e}")))?,
            };
            if !seen.insert(id.to_string()) {
                return Err(err(no, format!("client {id:?} appears twice")));
            }
            entries.push(ResourceEntry {
                id: id.to_string(),
                request,
                limit,
                gpu_mem,
                class,
            });
        }
        if entries.len() < declared {
            return Err(ResourceConfigError::TooFew {
                declared,
                found: entries.len(),
            });
        }
        Ok(ResourceConfig { entries })
    }

    /// The file's text, entries in the given order, ending with a newline. The class column
    /// only where it is not the default: a config of guaranteed clients reads as Gemini's.
    pub fn render(&self) -> String {
        let mut s = format!("{}\n", self.entries.len());
        for e in &self.entries {
            let _ = write!(s, "{} {} {} {}", e.id, e.request, e.limit, e.gpu_mem);
            if e.class != ClientClass::default() {
                let _ = write!(s, " {}", e.class);
            }
            s.push('\n');
        }
        s
    }

    pub fn get(&self, id: &str) -> Option<&ResourceEntry> {
        self.entries.iter().find(|e| e.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_order() {
        let text = "2\npod-a 0.3 0.5 1024\npod-b 0.5 1.0 2048\n";
        let c = ResourceConfig::parse(text).unwrap();
        assert_eq!(c.entries[0].request.get(), 300);
        assert_eq!(c.entries[0].limit.get(), 500);
        assert_eq!(c.render(), text);
        assert_eq!(ResourceConfig::parse("0\n").unwrap().entries.len(), 0);
    }

    #[test]
    fn the_class_column_is_optional_and_guaranteed_by_default() {
        let text = "3\na 0.3 0.5 1 opportunistic\nb 0.5 1.0 2\nc 0.2 0.2 3 guaranteed\n";
        let c = ResourceConfig::parse(text).unwrap();
        let classes: Vec<ClientClass> = c.entries.iter().map(|e| e.class).collect();
        assert_eq!(
            classes,
            [
                ClientClass::Opportunistic,
                ClientClass::Guaranteed,
                ClientClass::Guaranteed
            ]
        );
        // The default class is not written: a guaranteed line reads as Gemini's four columns.
        assert_eq!(
            c.render(),
            "3\na 0.3 0.5 1 opportunistic\nb 0.5 1.0 2\nc 0.2 0.2 3\n"
        );
        assert_eq!(ResourceConfig::parse(&c.render()).unwrap(), c);
    }

    #[test]
    fn a_pods_priority_gives_its_class() {
        assert_eq!(ClientClass::of_priority(0), ClientClass::Opportunistic);
        assert_eq!(ClientClass::of_priority(1), ClientClass::Guaranteed);
        assert_eq!(ClientClass::of_priority(100), ClientClass::Guaranteed);
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            (
                "",
                "line 1: the file is empty; the first line must be the number of entries",
            ),
            ("x\n", "line 1: \"x\" is not the number of entries"),
            (
                "1\na 0.5 0.5\n",
                "line 2: expected 4 or 5 fields `ID REQUEST LIMIT GPU_MEM [CLASS]`, found 3",
            ),
            (
                "1\na 0.5 0.5 1 opportunistic x\n",
                "line 2: expected 4 or 5 fields `ID REQUEST LIMIT GPU_MEM [CLASS]`, found 6",
            ),
            (
                "1\na 0.5 0.5 1 Guaranteed\n",
                "line 2: CLASS: \"Guaranteed\" is not a class (guaranteed or opportunistic)",
            ),
            (
                "1\na 0.5 0.5 1 0\n",
                "line 2: CLASS: \"0\" is not a class (guaranteed or opportunistic)",
            ),
            (
                "1\na 0.7 0.5 1\n",
                "line 2: REQUEST 0.7 is above LIMIT 0.5 (Gemini's order is ID REQUEST LIMIT GPU_MEM)",
            ),
            (
                "1\na 1.5 2 1\n",
                "line 2: REQUEST \"1.5\": must be at most 1.0 (a share from 0 to 1.0)",
            ),
            (
                "1\na 0.5 0.5 -1\n",
                "line 2: GPU_MEM \"-1\" is not a byte count",
            ),
            (
                "2\na 0.5 0.5 1\n",
                "the file declares 2 entries on line 1 but has only 1",
            ),
            (
                "1\na 0.5 0.5 1\nb 0.1 0.1 1\n",
                "line 3: line 1 declares 1 entries but more lines follow",
            ),
            (
                "2\na 0.5 0.5 1\na 0.1 0.1 1\n",
                "line 3: client \"a\" appears twice",
            ),
            (
                "1\n.. 0.5 0.5 1\n",
                "line 2: \"..\" is not a valid client ID",
            ),
        ];
        for (text, msg) in cases {
            assert_eq!(
                ResourceConfig::parse(text).unwrap_err().to_string(),
                msg,
                "{text:?}"
            );
        }
    }
}
