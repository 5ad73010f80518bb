#!/usr/bin/env bash
# KubeShare's container images without Docker or a registry: one root filesystem
# per image from `cargo build --release` outputs (plus the shared libraries they
# load), packed as OCI archives with umoci, for hack/node.sh to import into the
# test node's containerd. The Dockerfile runs `stage` too, so both paths put the
# same files in the same images; `check-dockerfile` keeps the entry points equal.
#
# Usage:
#   hack/images.sh build [OUT [IMG..]] stage and pack the images (default all) as OUT/<image>.tar
#                                    (OUT default target/images)
#   hack/images.sh stage OUT [IMG..] lay out OUT/<image>/rootfs (what the Dockerfile's build stage runs)
#   hack/images.sh check-dockerfile  fail if the Dockerfile's stages differ from the table below
#   hack/images.sh list              print the table
# Env: KUBESHARE_IMAGES_PROFILE (cargo profile dir under target/, default release),
#      CARGO_TARGET_DIR, KUBESHARE_K8S_BIN (kube-scheduler for the node's image).
# `build` needs umoci, jq, gcc (static pause), and the release binaries:
#   cargo build --release --locked -p kubeshare-scheduler -p kubeshare-webhook \
#     -p kubeshare-node-daemon -p gem-schd -p gemhook -p fake-libcuda
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$REPO/target}/${KUBESHARE_IMAGES_PROFILE:-release}"

log() { echo "images: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The kube-scheduler image the manifest names (one pin, in manifests/), or the one
# of the Kubernetes version the rig runs when K8S_VERSION picks another
# (hack/deploy.sh installs the chart with the same reference).
scheduler_ref() {
  if [[ -n "${K8S_VERSION:-}" ]]; then
    echo "registry.k8s.io/kube-scheduler:$K8S_VERSION"
  else
    grep -o 'registry.k8s.io/kube-scheduler:[^ ]*' "$REPO/manifests/kube-scheduler.yaml" | head -n 1
  fi
}

# name|reference|entrypoint|user|env (comma-separated)|in Dockerfile
# The references are those manifests/ name (imagePullPolicy: IfNotPresent).
table() {
  cat <<EOF
extender|docker.io/kubeshare/kubeshare-extender:latest|/usr/local/bin/kubeshare-extender|65532:65532||yes
webhook|docker.io/kubeshare/kubeshare-webhook:latest|/usr/local/bin/kubeshare-webhook|65532:65532||yes
node-daemon|docker.io/kubeshare/kubeshare-node-daemon:latest|/usr/local/bin/kubeshare-node-daemon|0:0||yes
workload|docker.io/kubeshare/cuda-workload:latest|/usr/local/bin/cuda-workload|0:0|NVIDIA_VISIBLE_DEVICES=all,PATH=/usr/local/bin:/bin|yes
kube-scheduler|$(scheduler_ref)|/usr/local/bin/kube-scheduler|65532:65532|PATH=/usr/local/bin:/bin|no
pause|registry.k8s.io/pause:3.10|/pause|65535:65535||no
EOF
}

# copy_elf ROOTFS FILE DEST: FILE at DEST in ROOTFS, with every shared library it
# loads at the path the dynamic linker finds it (ldd), so no base image is needed.
copy_elf() {
  local root="$1" file="$2" dest="$3" lib
  [[ -f "$file" ]] || die "missing $file (build it first; see hack/images.sh --help)"
  install -D -m 0755 "$file" "$root$dest"
  # Debug info is most of a debug build's size (and import time); symbols stay.
  strip --strip-debug "$root$dest" 2>/dev/null || true
  while read -r lib; do
    [[ -n "$lib" && -e "$lib" ]] || continue
    [[ -e "$root$lib" ]] || install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
  done < <(ldd "$file" 2>/dev/null | grep -o '/[^ ]*' || true)
}

stage_one() {
  local out="$1" name="$2" root="$1/$2/rootfs"
  rm -rf "${out:?}/$name"
  mkdir -p "$root/tmp"
  chmod 1777 "$root/tmp"
  case "$name" in
    extender) copy_elf "$root" "$TARGET/kubeshare-extender" /usr/local/bin/kubeshare-extender ;;
    webhook) copy_elf "$root" "$TARGET/kubeshare-webhook" /usr/local/bin/kubeshare-webhook ;;
    node-daemon)
      copy_elf "$root" "$TARGET/kubeshare-node-daemon" /usr/local/bin/kubeshare-node-daemon
      copy_elf "$root" "$TARGET/gem-schd" /usr/local/bin/gem-schd
      copy_elf "$root" "$TARGET/libgemhook.so" /usr/local/lib/kubeshare/libgemhook.so.1
      # NVML (the driver's libnvidia-ml.so.1, which the daemon loads at run time) links
      # glibc's libpthread, libdl and librt, which the daemon itself does not.
      local libc_dir lib
      libc_dir="$(dirname "$(ldd "$TARGET/kubeshare-node-daemon" | grep -o '/[^ ]*/libc\.so\.6' | head -n 1)")"
      for lib in libpthread.so.0 libdl.so.2 librt.so.1; do
        [[ -e "$libc_dir/$lib" ]] && install -D -m 0755 "$(readlink -f "$libc_dir/$lib")" "$root$libc_dir/$lib"
      done ;;
    workload)
      # A CUDA program with the fake driver where a CUDA image has the real one's
      # (NVIDIA's runtime mounts libcuda.so.1 there), and a shell for tests.
      copy_elf "$root" "$TARGET/cuda-workload" /usr/local/bin/cuda-workload
      copy_elf "$root" "$TARGET/libfake_cuda.so" /usr/lib/x86_64-linux-gnu/libcuda.so.1
      # The hook the node daemon installs is loaded from a hostPath; its libraries are in the image.
      [[ -f "$TARGET/libgemhook.so" ]] && copy_elf "$root" "$TARGET/libgemhook.so" /usr/local/lib/kubeshare/libgemhook.so.1
      copy_elf "$root" "$(command -v busybox)" /bin/busybox
      local app
      for app in sh env cat ls sleep grep test echo wc head tail id tr true false date seq touch mkdir; do ln -sf busybox "$root/bin/$app"; done ;;
    kube-scheduler)
      local bin="${KUBESHARE_K8S_BIN:-}"
      [[ -n "$bin" ]] || bin="$("$HACK/build-k8s.sh" | tail -n 1)"
      copy_elf "$root" "$bin/kube-scheduler" /usr/local/bin/kube-scheduler ;;
    pause)
      mkdir -p "$out/.build"
      gcc -Os -static -o "$out/.build/pause" "$HACK/images/pause.c"
      install -D -m 0755 "$out/.build/pause" "$root/pause" ;;
    *) die "unknown image $name" ;;
  esac
}

cmd_stage() {
  local out="$1"; shift
  mkdir -p "$out"
  local names=("$@")
  if ((${#names[@]} == 0)); then mapfile -t names < <(table | cut -d'|' -f1); fi
  local n
  for n in "${names[@]}"; do stage_one "$out" "$n"; log "staged $n"; done
}

cmd_build() {
  local out="${1:-$REPO/target/images}"
  shift || true
  local only=("$@")
  for b in umoci jq gcc busybox ldd; do command -v "$b" >/dev/null || die "$b is required"; done
  local t0; t0=$(date +%s%N)
  mkdir -p "$out"
  local work="$out/.work"
  rm -rf "$work"
  cmd_stage "$work" "${only[@]}"
  local name ref entry user env _ layout
  while IFS='|' read -r name ref entry user env _; do
    [[ -d "$work/$name" ]] || continue
    [[ -n "$ref" ]] || die "no reference for $name"
    layout="$work/$name/oci"
    umoci init --layout "$layout"
    umoci new --image "$layout:img"
    umoci unpack --image "$layout:img" "$work/$name/bundle" >/dev/null
    cp -a "$work/$name/rootfs/." "$work/$name/bundle/rootfs/"
    umoci repack --image "$layout:img" "$work/$name/bundle"
    local cfg=(--config.entrypoint "$entry" --config.user "$user" --clear=config.cmd)
    local e
    if [[ -n "$env" ]]; then IFS=',' read -ra envs <<<"$env"; for e in "${envs[@]}"; do cfg+=(--config.env "$e"); done; fi
    umoci config --image "$layout:img" "${cfg[@]}" --tag final
    umoci rm --image "$layout:img"
    umoci gc --layout "$layout"
    # containerd imports by the full reference in the index's ref.name annotation.
    jq --arg ref "$ref" '.manifests |= map(.annotations["org.opencontainers.image.ref.name"] = $ref)' \
      "$layout/index.json" >"$layout/index.json.tmp"
    mv "$layout/index.json.tmp" "$layout/index.json"
    tar -C "$layout" -cf "$out/$name.tar.tmp" .
    mv "$out/$name.tar.tmp" "$out/$name.tar"
    echo "$ref" >"$out/$name.ref"
    log "$name -> $out/$name.tar ($ref, $(du -h "$out/$name.tar" | cut -f1))"
  done < <(table)
  rm -rf "$work"
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  log "built in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s"
}

# Each image the Dockerfile also builds has a stage named after it that copies
# the staged rootfs and sets the same ENTRYPOINT and USER.
cmd_check_dockerfile() {
  local df="$REPO/Dockerfile" name ref entry user env docker bad=0
  while IFS='|' read -r name ref entry user env docker; do
    [[ "$docker" == yes ]] || continue
    local stage
    stage="$(awk -v n="$name" '$1=="FROM" && $NF==n {on=1; next} $1=="FROM" {on=0} on' "$df")"
    if [[ -z "$stage" ]]; then log "Dockerfile has no stage $name"; bad=1; continue; fi
    grep -qF "COPY --from=build /out/$name/rootfs/ /" <<<"$stage" || { log "stage $name does not copy /out/$name/rootfs"; bad=1; }
    grep -qF "ENTRYPOINT [\"$entry\"]" <<<"$stage" || { log "stage $name: ENTRYPOINT is not [\"$entry\"]"; bad=1; }
    grep -qxF "USER $user" <<<"$stage" || { log "stage $name: USER is not $user"; bad=1; }
    if [[ -n "$env" ]]; then
      local e; IFS=',' read -ra envs <<<"$env"
      for e in "${envs[@]}"; do grep -qxF "ENV $e" <<<"$stage" || { log "stage $name lacks ENV $e"; bad=1; }; done
    fi
  done < <(table)
  (( bad == 0 )) || die "Dockerfile and hack/images.sh disagree"
  log "Dockerfile matches hack/images.sh"
}

case "${1:-}" in
  build) shift; cmd_build "$@" ;;
  stage) shift; [[ $# -ge 1 ]] || die "stage needs OUT"; cmd_stage "$@" ;;
  check-dockerfile) cmd_check_dockerfile ;;
  list) table ;;
  *) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
