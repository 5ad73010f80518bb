//! CDI on the real node: a container that is handed `kubeshare.io/gpu=<uuid>` gets that
//! GPU's device node, the control node, the driver library and the hook's env from the
//! node daemon's spec; a container that is not gets none of them.
//!
//! Needs `KUBESHARE_NODE_CDI=1` when the node comes up (hack/node.sh then runs the
//! containerd 2.x of hack/build-containerd.sh with CDI on, its spec dir
//! RUN_DIR/node/cdi); without it the test says so and checks nothing. The kubelet hands
//! CDI devices to the runtime only from a device plugin's `Allocate` (or a DRA driver),
//! never from pod annotations, so the test device plugin plays the device plugin. The
//! node has no NVIDIA driver: the device nodes are stand-ins made with mknod in
//! RUN_DIR/node/cdi-dev (the spec's host paths), with the driver's major number.

use std::path::Path;

use kubeshare_node_daemon::cdi::host::{self as cdi, CdiConfig, Synced};

use super::*;

const RESOURCE: &str = "cdi-test.kubeshare.io/gpu";
/// The major number of NVIDIA's character devices; nvidiactl is minor 255.
const NVIDIA_MAJOR: u32 = 195;

fn mknod(path: &Path, minor: u32) -> Result<()> {
    let st = std::process::Command::new("mknod")
        .arg(path)
        .arg("c")
        .arg(NVIDIA_MAJOR.to_string())
        .arg(minor.to_string())
        .status()?;
    ensure!(st.success(), "mknod {} failed", path.display());
    Ok(())
}

fn probe_pod(name: &str, request: bool, lib: &str) -> Result<Pod> {
    let script = format!(
        "for d in /dev/nvidia*; do if [ -c $d ]; then echo \"DEV $d\"; fi; done; \
         echo LIB=$(cat {lib} 2>/dev/null || echo none); \
         echo PRELOAD=${{LD_PRELOAD:-none}}; echo DONE; sleep 3600"
    );
    let resources = if request {
        json!({"limits": {RESOURCE: "1"}})
    } else {
        json!({})
    };
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            // Not a KubeShare pod: the GPU-node taint is tolerated by hand.
            "tolerations": [{"key": "kubeshare.io/gpu", "operator": "Exists"}],
            "containers": [{"name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script], "resources": resources}],
        }
    }))?)
}

#[tokio::test]
#[ignore = "needs the real node with KUBESHARE_NODE_CDI=1: make node-test"]
async fn a_cdi_gpu_reaches_only_the_container_it_is_given_to() -> Result<()> {
    if std::env::var("KUBESHARE_NODE_CDI").as_deref() != Ok("1") {
        eprintln!(
            "KUBESHARE_NODE_CDI is not 1: the node runs a containerd without CDI; nothing checked"
        );
        return Ok(());
    }
    let r = rig("rn-cdi").await?;
    ensure!(
        r.node.env("CTRD_BIN").is_some(),
        "the node came up without CDI (hack/node.sh up with KUBESHARE_NODE_CDI=1)"
    );
    let inv = daemon::node_inventory(&r.client, &r.node.name).await?;
    let gpu = inv.gpus.iter().max_by_key(|g| g.index).context("no GPUs")?;

    // The host as the spec sees it: stand-in device nodes and a driver library dir.
    let dev = r.node.dir.join("cdi-dev");
    std::fs::create_dir_all(&dev)?;
    for g in &inv.gpus {
        mknod(&dev.join(format!("nvidia{}", g.index)), g.index)?;
    }
    mknod(&dev.join("nvidiactl"), 255)?;
    let libs = r.node.dir.join("test/cdi-lib");
    std::fs::create_dir_all(&libs)?;
    let version = format!("libcuda.so.{}", unique());
    std::fs::write(libs.join(&version), "driver\n")?;
    std::os::unix::fs::symlink(&version, libs.join("libcuda.so.1"))?;
    let cfg = CdiConfig {
        spec_dir: r.node.dir.join("cdi"),
        dev_dir: dev.clone(),
        lib_dirs: vec![libs.clone()],
        layout: kubeshare_api::Layout::default(),
    };
    // The hook's host directory must exist: the runtime bind-mounts it.
    ensure!(
        r.node.kubeshare_path("lib").is_dir(),
        "the node daemon has not made {}",
        r.node.kubeshare_path("lib").display()
    );
    let host = cdi::host_view(&cfg);
    assert_eq!(host.libs.len(), 2, "{:?}", host.libs);
    assert_eq!(cdi::sync(&cfg, &inv.gpus, &host)?, Synced::Written);

    let run_dir = r.node.dir.parent().context("node dir has no parent")?;
    let node_sh = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/node.sh");
    let mut plugin = tokio::process::Command::new(node_sh)
        .arg("exec")
        .arg(run_dir)
        .arg(env!("CARGO_BIN_EXE_kubeshare-test-device-plugin"))
        .arg(format!("--resource={RESOURCE}"))
        .arg(format!("--devices={}", gpu.uuid))
        .arg("--endpoint=kubeshare-test-cdi.sock")
        .arg(format!(
            "--cdi-kind={}",
            kubeshare_node_daemon::cdi::generate::KIND
        ))
        .kill_on_drop(true)
        .spawn()
        .context("cannot start the test device plugin")?;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(r.client.clone());
    wait_for(&nodes, &r.node.name, WAIT, |n| {
        n.status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(RESOURCE))
            .is_some_and(|q| q.0 == "1")
    })
    .await?;

    let lib = libs.join("libcuda.so.1").to_string_lossy().into_owned();
    create(&r.pods, &probe_pod("with", true, &lib)?).await?;
    create(&r.pods, &probe_pod("without", false, &lib)?).await?;
    running(&r.pods, "with").await?;
    running(&r.pods, "without").await?;
    let with = wait_for_log(&r.pods, "with", "main", "DONE", WAIT).await?;
    let without = wait_for_log(&r.pods, "without", "main", "DONE", WAIT).await?;
    let devs = |log: &str| -> Vec<String> {
        let mut d: Vec<String> = log
            .lines()
            .filter_map(|l| l.strip_prefix("DEV "))
            .map(str::to_string)
            .collect();
        d.sort();
        d
    };
    // Only the GPU it was given (by UUID), and the control node.
    let mut want = vec![
        format!("/dev/nvidia{}", gpu.index),
        "/dev/nvidiactl".to_string(),
    ];
    want.sort();
    assert_eq!(devs(&with), want, "{with}");
    assert_eq!(field(&with, "LIB"), Some("driver"), "{with}");
    assert_eq!(
        field(&with, "PRELOAD"),
        Some(kubeshare_api::layout::POD_HOOK_LIB),
        "{with}"
    );
    assert!(devs(&without).is_empty(), "{without}");
    assert_eq!(field(&without, "LIB"), Some("none"), "{without}");
    assert_eq!(field(&without, "PRELOAD"), Some("none"), "{without}");

    plugin.kill().await?;
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}
