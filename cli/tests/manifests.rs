//! The deployable manifests (`manifests/*.yaml`) against the real control plane of
//! the test rig: the API server accepts them in a server-side dry-run apply (schema,
//! strict field validation, admission), the real kube-scheduler accepts the
//! KubeSchedulerConfiguration they carry, no RBAC rule uses a wildcard, and the
//! pieces agree with each other (extender address, hostPath, NODE_NAME).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine as _;
use kubeshare_testkit::Cluster;
use serde_json::Value;

fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests")
}

/// Every manifest file, in the order `kubectl apply -f manifests/` reads them.
fn manifest_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(manifests_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "manifests missing: {files:?}");
    files
}

/// All manifests as one stream, with the webhook's `CA_BUNDLE` placeholder
/// replaced by a real CA (the rig's), as an installer does.
fn manifests_with_ca(cluster: &Cluster) -> String {
    let ca = std::fs::read(cluster.ca_cert_path()).unwrap();
    let ca = base64::engine::general_purpose::STANDARD.encode(ca);
    manifest_files()
        .iter()
        .map(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .replace("CA_BUNDLE", &ca)
        })
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// Runs `cmd` with `stdin`; returns (success, stdout, stderr).
fn run(mut cmd: Command, stdin: &str) -> (bool, String, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The manifests as JSON objects (kubectl's own YAML decoding, client side).
fn objects(cluster: &Cluster) -> Vec<Value> {
    let mut cmd = cluster.kubectl().unwrap();
    cmd.args(["create", "--dry-run=client", "-o", "json", "-f", "-"]);
    let (ok, out, err) = run(cmd, &manifests_with_ca(cluster));
    assert!(ok, "kubectl could not read the manifests: {err}");
    serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map(Result::unwrap)
        .collect()
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in manifests/"))
}

fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

#[test]
fn manifests_pass_a_server_side_dry_run_apply() {
    let cluster = Cluster::shared().expect("test cluster");
    let mut cmd = cluster.kubectl().unwrap();
    cmd.args(["apply", "--dry-run=server", "--validate=strict", "-f", "-"]);
    let (ok, out, err) = run(cmd, &manifests_with_ca(cluster));
    assert!(
        ok,
        "server-side dry run refused the manifests:\n{err}\n{out}"
    );
    for object in [
        "namespace/kubeshare-system",
        "configmap/kubeshare-scheduler-config",
        "deployment.apps/kubeshare-scheduler",
        "clusterrolebinding.rbac.authorization.k8s.io/kubeshare:scheduler-as-kube-scheduler",
        "daemonset.apps/kubeshare-node-daemon",
        "deployment.apps/kubeshare-webhook",
        "service/kubeshare-webhook",
        "mutatingwebhookconfiguration.admissionregistration.k8s.io/kubeshare-webhook",
        "validatingadmissionpolicy.admissionregistration.k8s.io/kubeshare-record",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/kubeshare-record",
        "validatingadmissionpolicy.admissionregistration.k8s.io/kubeshare-namespace-opt-out",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/kubeshare-namespace-opt-out",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("{object} ")) && l.ends_with("(server dry run)")),
            "{object} not in the dry-run output:\n{out}"
        );
    }
}

#[test]
fn no_rbac_rule_uses_a_wildcard() {
    let cluster = Cluster::shared().expect("test cluster");
    let objs = objects(cluster);
    let mut rules = 0;
    for o in objs
        .iter()
        .filter(|o| o["kind"] == "ClusterRole" || o["kind"] == "Role")
    {
        for rule in o["rules"].as_array().unwrap() {
            rules += 1;
            for field in ["apiGroups", "resources", "verbs", "resourceNames"] {
                if let Some(list) = rule[field].as_array() {
                    assert!(
                        list.iter()
                            .all(|v| v.as_str().is_some_and(|s| !s.contains('*'))),
                        "{} {}: wildcard in {field}: {rule}",
                        o["kind"],
                        o["metadata"]["name"]
                    );
                }
            }
            assert!(rule.get("nonResourceURLs").is_none(), "{rule}");
        }
    }
    assert!(rules > 0, "no RBAC rules found in manifests/");
    // Bindings grant named roles only; none grants cluster-admin.
    for b in objs
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
    {
        assert_ne!(b["roleRef"]["name"], "cluster-admin", "{b}");
    }
}

#[test]
fn the_pieces_agree() {
    let cluster = Cluster::shared().expect("test cluster");
    let objs = objects(cluster);

    // The second scheduler calls the extender on loopback, where the sidecar listens.
    let cm = find(&objs, "ConfigMap", "kubeshare-scheduler-config");
    let config = cm["data"]["scheduler-config.yaml"].as_str().unwrap();
    assert!(
        config.contains("schedulerName: kubeshare-scheduler"),
        "{config}"
    );
    assert!(
        config.contains("urlPrefix: http://127.0.0.1:8888"),
        "{config}"
    );
    let sched = find(&objs, "Deployment", "kubeshare-scheduler");
    let ext = container(sched, "extender");
    assert!(
        ext["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--listen=127.0.0.1:8888"),
        "{ext}"
    );
    let ks = container(sched, "kube-scheduler");
    assert!(
        ks["image"]
            .as_str()
            .unwrap()
            .starts_with("registry.k8s.io/kube-scheduler:v1.34."),
        "{ks}"
    );

    // The node daemon: NODE_NAME from the downward API, the host directory.
    let ds = find(&objs, "DaemonSet", "kubeshare-node-daemon");
    let nd = container(ds, "node-daemon");
    let node_name = nd["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .expect("NODE_NAME env");
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    let vols = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    assert!(
        vols.iter()
            .any(|v| v["hostPath"]["path"] == "/var/lib/kubeshare"),
        "{vols:?}"
    );
    assert!(
        nd["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--root=/var/lib/kubeshare"),
        "{nd}"
    );

    // The webhook configurations point at the Service that fronts the webhook pods.
    let svc = find(&objs, "Service", "kubeshare-webhook");
    let mwc = find(&objs, "MutatingWebhookConfiguration", "kubeshare-webhook");
    let cc = &mwc["webhooks"][0]["clientConfig"]["service"];
    assert_eq!(cc["name"], svc["metadata"]["name"]);
    assert_eq!(cc["namespace"], svc["metadata"]["namespace"]);
}

#[test]
fn kube_scheduler_accepts_the_scheduler_config() {
    let cluster = Cluster::shared().expect("test cluster");
    let objs = objects(cluster);
    let cm = find(&objs, "ConfigMap", "kubeshare-scheduler-config");
    let config = cm["data"]["scheduler-config.yaml"].as_str().unwrap();
    // In the pod the kubeconfig is the ServiceAccount's; here, the rig's.
    let kubeconfig = cluster
        .kubeconfig(kubeshare_testkit::Identity::KubeScheduler)
        .unwrap();
    assert!(config.contains("kubeconfig: \"\""), "{config}");
    let config = config.replace(
        "kubeconfig: \"\"",
        &format!("kubeconfig: {}", kubeconfig.display()),
    );
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("config.yaml");
    let written = dir.path().join("written.yaml");
    std::fs::write(&input, &config).unwrap();
    // --write-config-to loads, defaults and validates the file (strictly: unknown
    // fields and invalid extender settings fail), writes the result and exits.
    let out = Command::new(cluster.bin_dir().join("kube-scheduler"))
        .arg(format!("--config={}", input.display()))
        .arg(format!("--write-config-to={}", written.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kube-scheduler refused the config:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let effective = std::fs::read_to_string(&written).unwrap();
    assert!(
        effective.contains("schedulerName: kubeshare-scheduler"),
        "{effective}"
    );
    assert!(effective.contains("bindVerb: bind"), "{effective}");

    // The check can fail: a misspelt field is refused.
    let bad = config.replace("filterVerb", "filtrVerb");
    std::fs::write(&input, bad).unwrap();
    let out = Command::new(cluster.bin_dir().join("kube-scheduler"))
        .arg(format!("--config={}", input.display()))
        .arg(format!("--write-config-to={}", written.display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("filtrVerb"));
}
