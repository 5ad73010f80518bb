//! Where the node's GPU inventory comes from: NVML on a real GPU node, or a file in
//! fake mode (kwok nodes, tests, the demo).
//!
//! The fake file holds exactly the JSON of the Node annotation `sharedgpu/inventory`
//! (`{"gpus":[{"uuid":"GPU-…","index":0,"model":"NVIDIA-H100-80GB-HBM3","memory":85520809984}]}`,
//! optional `numa_node` and `nvlink_peers`), validated the same way. It is re-read on
//! every resync, so editing it simulates a GPU change.

use std::path::PathBuf;

use kubeshare_api::NodeInventory;

#[derive(Debug, Clone)]
pub enum InventorySource {
    Nvml { library: PathBuf },
    Fake { file: PathBuf },
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Nvml(#[from] crate::nvml::NvmlError),
    #[error("cannot read the fake inventory {file}: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("fake inventory {file}: {source}")]
    Parse {
        file: PathBuf,
        source: kubeshare_api::InventoryError,
    },
}

impl InventorySource {
    pub fn load(&self) -> Result<NodeInventory, SourceError> {
        match self {
            InventorySource::Nvml { library } => Ok(crate::nvml::discover(library)?),
            InventorySource::Fake { file } => {
                let text = std::fs::read_to_string(file).map_err(|source| SourceError::Read {
                    file: file.clone(),
                    source,
                })?;
                let mut inv = NodeInventory::parse(&text).map_err(|source| SourceError::Parse {
                    file: file.clone(),
                    source,
                })?;
                inv.gpus.sort_by_key(|g| g.index);
                Ok(inv)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_file_is_the_annotation_json() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("inv.json");
        std::fs::write(
            &f,
            r#"{"gpus":[
              {"uuid":"GPU-00000001-aaaa-bbbb-cccc-dddddddddddd","index":1,"model":"NVIDIA-H100-80GB-HBM3","memory":100},
              {"uuid":"GPU-00000000-aaaa-bbbb-cccc-dddddddddddd","index":0,"model":"NVIDIA-H100-80GB-HBM3","memory":100,"numa_node":1}
            ]}"#,
        )
        .unwrap();
        let inv = InventorySource::Fake { file: f.clone() }.load().unwrap();
        assert_eq!(inv.gpus[0].index, 0);
        assert_eq!(inv.gpus[0].numa_node, Some(1));

        std::fs::write(
            &f,
            r#"{"gpus":[{"uuid":"nope","index":0,"model":"M","memory":1}]}"#,
        )
        .unwrap();
        let e = InventorySource::Fake { file: f.clone() }
            .load()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "fake inventory {}: GPU 0: \"nope\" is not a GPU UUID",
                f.display()
            )
        );
        let e = InventorySource::Fake {
            file: d.path().join("missing"),
        }
        .load()
        .unwrap_err();
        assert!(
            e.to_string().starts_with("cannot read the fake inventory"),
            "{e}"
        );
    }
}
