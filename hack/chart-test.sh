#!/usr/bin/env bash
# Checks the Helm chart (charts/kubeshare) the way a user meets it:
#   1. `helm lint` with the defaults and with each certificate mode and the
#      ServiceMonitor on; a bad value is refused with a message naming it;
#   2. manifests/ is the chart rendered (hack/render-manifests.sh --check);
#   3. the chart's self-signed webhook certificate names the webhook Service and
#      is signed by the CA the webhook configurations carry;
#   4. with a cluster (KUBECONFIG set, e.g. under hack/with-cluster.sh): the
#      rendered chart passes a server-side dry run of `kubectl apply` (manifests/ has
#      its own in cli/tests/manifests.rs).
# Usage: hack/chart-test.sh        (make chart-test runs it under a cluster)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$REPO/charts/kubeshare"
HELM="${HELM:-$("$REPO/hack/build-helm.sh" | tail -n 1)}"
NS=kubeshare-system
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
log() { echo "chart-test: $*" >&2; }
die() { log "FAIL: $*"; exit 1; }

# ------------------------------------------------------------------ 1. lint
for set in "" "--set webhook.certs.mode=certManager" "--set webhook.certs.mode=manual" \
           "--set metrics.serviceMonitor.enabled=true" "--set gpuNodeTaint.enabled=false" \
           "--set metrics.grafanaDashboard.enabled=true" "--set nodeDaemon.devicePlugin.enabled=false"; do
  # shellcheck disable=SC2086
  "$HELM" lint --strict "$CHART" --namespace "$NS" $set >"$WORK/lint.log" 2>&1 \
    || { cat "$WORK/lint.log" >&2; die "helm lint ${set:-(defaults)}"; }
done
log "helm lint: defaults, certManager, manual, serviceMonitor, no taint, dashboard, no device-plugin mode"
# The dashboard is valid JSON with panels, and the ConfigMap carries it.
jq -e '.panels | length > 0' "$CHART/dashboards/kubeshare.json" >/dev/null || die "dashboards/kubeshare.json"
"$HELM" template kubeshare "$CHART" --set metrics.grafanaDashboard.enabled=true \
  --show-only templates/grafana-dashboard.yaml | grep -q '"uid": "kubeshare-shares"' || die "dashboard ConfigMap"
if "$HELM" template kubeshare "$CHART" --set webhook.certs.mode=bogus >"$WORK/bad.log" 2>&1; then
  die "webhook.certs.mode=bogus was accepted"
fi
grep -q 'webhook.certs.mode="bogus"' "$WORK/bad.log" || { cat "$WORK/bad.log" >&2; die "the error does not name the bad value"; }
log "a bad webhook.certs.mode is refused by name"
# Another scheduler name reaches the profile, the webhook's match conditions and every
# component's environment; one that is not a DNS name is refused by name.
named="$("$HELM" template kubeshare "$CHART" --set schedulerName=gpu-share)"
[[ "$(grep -c "gpu-share" <<<"$named")" == 6 ]] || die "schedulerName=gpu-share is not in the 6 places it belongs"
! grep -q "'kubeshare-scheduler'\|^    - schedulerName: kubeshare-scheduler\|value: \"kubeshare-scheduler\"" <<<"$named" \
  || die "schedulerName=gpu-share left the default name somewhere"
if "$HELM" template kubeshare "$CHART" --set "schedulerName=Bad_Name" >"$WORK/bad.log" 2>&1; then
  die "schedulerName=Bad_Name was accepted"
fi
grep -q 'schedulerName="Bad_Name"' "$WORK/bad.log" || { cat "$WORK/bad.log" >&2; die "the error does not name the bad scheduler name"; }
log "schedulerName: set everywhere; a bad one is refused by name"

# DRA is off by default; on, the node daemon gets --dra and the DeviceClass is installed.
! "$HELM" template kubeshare "$CHART" | grep -q -- "- --dra$" || die "--dra is on by default"
dra="$("$HELM" template kubeshare "$CHART" --set dra.enabled=true --set 'dra.claimTemplateNamespaces={team-a}')"
[[ "$(grep -c -- "- --dra$" <<<"$dra")" == 1 && "$(grep -c "^kind: DeviceClass$" <<<"$dra")" == 1 \
   && "$(grep -c "^kind: ResourceClaimTemplate$" <<<"$dra")" == 2 ]] \
  || die "dra.enabled=true: expected --dra once, one DeviceClass and two ResourceClaimTemplates"
"$HELM" lint --strict "$CHART" --namespace "$NS" --set dra.enabled=true >"$WORK/lint.log" 2>&1 \
  || { cat "$WORK/lint.log" >&2; die "helm lint --set dra.enabled=true"; }
log "dra: off by default; on, --dra, the DeviceClass and the claim templates"

# CDI is off by default; on, the node daemon writes its spec into cdi.specDir and registers its
# device plugin in the kubelet's device-plugins/ (both hostPaths), and the webhook asks for
# kubeshare.io/gpu; cdi.devDir (stand-in device nodes) is mounted where the spec names it.
! "$HELM" template kubeshare "$CHART" | grep -q -- "--cdi-spec-dir\|--gpu-resource\|device-plugins" \
  || die "CDI is on by default"
cdi="$("$HELM" template kubeshare "$CHART" --set cdi.enabled=true --set cdi.kubeletRootDir=/srv/kubelet/ \
  --set cdi.devDir=/run/fake-dev)"
for want in "- --cdi-spec-dir=/var/run/cdi" "- --device-plugin-dir=/var/lib/kubelet/device-plugins" \
    "- --cdi-dev-dir=/run/fake-dev" \
    "- {name: cdi-spec, hostPath: {path: /var/run/cdi, type: DirectoryOrCreate}}" \
    "hostPath: {path: /srv/kubelet/device-plugins, type: Directory}" \
    "- {name: device-plugins, mountPath: /var/lib/kubelet/device-plugins}" \
    "- {name: cdi-dev, mountPath: /run/fake-dev, readOnly: true}" \
    '"--log-format", "json", "--gpu-resource", "kubeshare.io/gpu"]'; do
  [[ "$(grep -cF -- "$want" <<<"$cdi")" == 1 ]] || die "cdi.enabled=true: expected once: $want"
done
"$HELM" lint --strict "$CHART" --namespace "$NS" --set cdi.enabled=true >"$WORK/lint.log" 2>&1 \
  || { cat "$WORK/lint.log" >&2; die "helm lint --set cdi.enabled=true"; }
log "cdi: off by default; on, the spec dir, the device-plugin dir and the webhook's --gpu-resource"

# Co-running reaches gem-schd through the node daemon, on (0.6) by default, another value as
# set, off with 0; a value outside 0..1 is refused by name.
[[ "$("$HELM" template kubeshare "$CHART" | grep -c -- "- --gem-schd-arg=--co-run-below=0.6$")" == 1 ]] \
  || die "co-running (0.6) does not reach the node daemon's arguments once by default"
corun="$("$HELM" template kubeshare "$CHART" --set nodeDaemon.coRunBelow=0.45)"
[[ "$(grep -c -- "- --gem-schd-arg=--co-run-below=0.45$" <<<"$corun")" == 1 ]] \
  || die "nodeDaemon.coRunBelow=0.45 does not reach the node daemon's arguments once"
! "$HELM" template kubeshare "$CHART" --set nodeDaemon.coRunBelow=0 | grep -q -- "--co-run-below" \
  || die "nodeDaemon.coRunBelow=0 left co-running on"
if "$HELM" template kubeshare "$CHART" --set nodeDaemon.coRunBelow=1.5 >"$WORK/bad.log" 2>&1; then
  die "nodeDaemon.coRunBelow=1.5 was accepted"
fi
grep -q 'nodeDaemon.coRunBelow=1.5' "$WORK/bad.log" || { cat "$WORK/bad.log" >&2; die "the error does not name coRunBelow"; }
log "nodeDaemon.coRunBelow: 0.6 by default, passed to gem-schd as set, off with 0, a bad one refused by name"
# The node daemon's ClusterRole, from the rendered chart on stdin.
node_daemon_role() { awk '/^kind: ClusterRole$/{r=0} /^  name: kubeshare:node-daemon$/{r=1} /^---/{r=0} r'; }
evict="$("$HELM" template kubeshare "$CHART" --set nodeDaemon.evictUntrackedGpuPods=true)"
grep -q -- "--evict-untracked-gpu-pods=true" <<<"$evict" && node_daemon_role <<<"$evict" | grep -q 'pods/eviction' \
  || die "nodeDaemon.evictUntrackedGpuPods=true did not reach the node daemon with the right to evict"
plain="$("$HELM" template kubeshare "$CHART")"
node_daemon_role <<<"$plain" | grep -q 'resources: \["nodes"\]' || die "no node-daemon ClusterRole found"
! { grep -q -- "--evict-untracked-gpu-pods" <<<"$plain" || node_daemon_role <<<"$plain" | grep -q 'pods/eviction'; } \
  || die "the node daemon evicts (or may) by default"
log "nodeDaemon.evictUntrackedGpuPods: off by default, with pods/eviction only when on"

# Nodes without a pod network or NVIDIA's runtime (hack/gpu-node.sh): off by default; on,
# every KubeShare pod is on the host network with the apiserver's address, and the node
# daemon loads NVML from the driver dir, privileged; a half-given address is refused.
! "$HELM" template kubeshare "$CHART" | grep -q 'hostNetwork: true\|KUBERNETES_SERVICE_HOST\|privileged: true' \
  || die "hostNetwork, k8sServiceHost or privileged is on by default"
bare="$("$HELM" template kubeshare "$CHART" --set hostNetwork=true --set k8sServiceHost=10.0.0.1 \
  --set k8sServicePort=6443 --set nodeDaemon.driverLibDir=/usr/local/nvidia/lib64)"
[[ "$(grep -c '^      hostNetwork: true$' <<<"$bare")" == 3 \
   && "$(grep -c 'name: KUBERNETES_SERVICE_HOST, value: "10.0.0.1"' <<<"$bare")" == 4 \
   && "$(grep -c 'name: KUBERNETES_SERVICE_PORT, value: "6443"' <<<"$bare")" == 4 \
   && "$(grep -c -- '- --nvml-library=/usr/local/nvidia/lib64/libnvidia-ml.so.1$' <<<"$bare")" == 1 \
   && "$(grep -c '^          privileged: true$' <<<"$bare")" == 1 ]] \
  || die "hostNetwork / k8sServiceHost / driverLibDir do not reach the 3 pods, 4 containers, the daemon"
! grep -q -- '--cdi-lib-dir' <<<"$bare" || die "driverLibDir without cdi.enabled passed --cdi-lib-dir"
"$HELM" template kubeshare "$CHART" --set cdi.enabled=true --set nodeDaemon.driverLibDir=/usr/local/nvidia/lib64/ \
  | grep -qx -- '        - --cdi-lib-dir=/usr/local/nvidia/lib64' || die "cdi.enabled + driverLibDir: no --cdi-lib-dir"
if "$HELM" template kubeshare "$CHART" --set k8sServiceHost=10.0.0.1 >"$WORK/bad.log" 2>&1; then
  die "k8sServiceHost without k8sServicePort was accepted"
fi
grep -q 'k8sServicePort' "$WORK/bad.log" || { cat "$WORK/bad.log" >&2; die "the error does not name k8sServicePort"; }
log "hostNetwork, k8sServiceHost/Port, nodeDaemon.driverLibDir (and CDI's lib dir): off by default, on where they belong"

# ------------------------------------------------------------------ 2. manifests/
HELM="$HELM" "$REPO/hack/render-manifests.sh" --check
log "manifests/ is the chart rendered"

# ------------------------------------------------------------------ 3. certificates
"$HELM" template kubeshare "$CHART" --namespace "$NS" >"$WORK/chart.yaml"
secret_field() {
  awk -v f="$1" '/^kind: Secret/{s=1} s && $1==f":"{print $2; exit}' "$WORK/chart.yaml" | base64 -d
}
secret_field ca.crt >"$WORK/ca.crt"
secret_field tls.crt >"$WORK/tls.crt"
openssl verify -CAfile "$WORK/ca.crt" "$WORK/tls.crt" >/dev/null || die "tls.crt is not signed by ca.crt"
openssl x509 -in "$WORK/tls.crt" -noout -ext subjectAltName | grep -q "kubeshare-webhook.$NS.svc" \
  || die "tls.crt does not name kubeshare-webhook.$NS.svc"
bundles=$(grep -c "caBundle: $(base64 -w0 <"$WORK/ca.crt")" "$WORK/chart.yaml" || true)
[[ "$bundles" == 3 ]] || die "expected the CA in 3 webhook entries, found $bundles"
log "self-signed certificate: signed by the CA in all 3 webhook entries, names the Service"

# ------------------------------------------------------------------ 4. dry run
if [[ -z "${KUBECONFIG:-}" ]]; then
  log "no KUBECONFIG: server-side dry run skipped"
  exit 0
fi
KUBECTL="${KUBECTL:-${KUBESHARE_K8S_BIN:+$KUBESHARE_K8S_BIN/}kubectl}"
"$KUBECTL" create namespace "$NS" --dry-run=client -o yaml | "$KUBECTL" apply -f - >/dev/null
"$KUBECTL" apply --dry-run=server -f "$WORK/chart.yaml" >"$WORK/dry.log" 2>&1 \
  || { cat "$WORK/dry.log" >&2; die "the rendered chart fails a server-side dry run"; }
log "server-side dry run: the chart ($(grep -c '^kind:' "$WORK/chart.yaml") objects)"
