//! The resource-config file as gem-schd sees it (parsing belongs to `kubeshare-api`),
//! and the socket-path template.

use std::path::{Path, PathBuf};

use kubeshare_api::{ResourceConfig, ResourceConfigError};
use thiserror::Error;

use crate::core::ClientSpec;

/// Why a config file could not be loaded.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        source: ResourceConfigError,
    },
}

/// Parse the text of a resource-config file into client specs.
pub fn parse_specs(text: &str) -> Result<Vec<ClientSpec>, ResourceConfigError> {
    Ok(ResourceConfig::parse(text)?
        .entries
        .iter()
        .map(ClientSpec::from)
        .collect())
}

/// Read and parse the file at `path`; also returns the text (to detect changes).
pub fn load(path: &Path) -> Result<(String, Vec<ClientSpec>), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_owned(),
        source,
    })?;
    let specs = parse_specs(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })?;
    Ok((text, specs))
}

/// A socket-path template with `{client}` and `{gpu}` placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketTemplate(String);

/// A template without `{client}` would put every client on one socket.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("socket template {0:?} must contain {{client}}")]
pub struct TemplateError(String);

impl SocketTemplate {
    pub fn new(t: &str) -> Result<Self, TemplateError> {
        if t.contains("{client}") {
            Ok(SocketTemplate(t.to_owned()))
        } else {
            Err(TemplateError(t.to_owned()))
        }
    }

    /// The socket path of `client` on `gpu`. Client IDs are validated by the config
    /// parser (no `/`, not `.`/`..`), so they cannot escape the template's directory.
    pub fn path(&self, client: &str, gpu: &str) -> PathBuf {
        PathBuf::from(self.0.replace("{client}", client).replace("{gpu}", gpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs_in_gemini_order() {
        let s = parse_specs("2\na 0.3 0.5 100\nb 0.1 1.0 200\n").unwrap();
        assert_eq!(s[0].id, "a");
        assert_eq!(
            (s[0].request_milli, s[0].limit_milli, s[0].mem_limit),
            (300, 500, 100)
        );
        assert_eq!((s[1].request_milli, s[1].limit_milli), (100, 1000));
    }

    #[test]
    fn bad_file_names_the_line() {
        let e = parse_specs("2\na 0.3 0.5 100\nb x 1.0 200\n").unwrap_err();
        assert!(e.to_string().contains("line 3"), "{e}");
    }

    #[test]
    fn template_fills_both_placeholders() {
        let t = SocketTemplate::new("/r/{client}/{gpu}.sock").unwrap();
        assert_eq!(t.path("pod", "GPU-1"), PathBuf::from("/r/pod/GPU-1.sock"));
        assert!(SocketTemplate::new("/r/{gpu}.sock").is_err());
    }
}
