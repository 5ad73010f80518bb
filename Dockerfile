# syntax=docker/dockerfile:1
# KubeShare's images, from one multi-stage build:
#   docker build --target extender    -t kubeshare/kubeshare-extender:latest .
#   docker build --target webhook     -t kubeshare/kubeshare-webhook:latest .
#   docker build --target node-daemon -t kubeshare/kubeshare-node-daemon:latest .
#   docker build --target workload    -t kubeshare/cuda-workload:latest .   (tests: fake libcuda)
# (hack/kind-demo.sh builds the first three.) The `build` stage compiles the
# workspace once (BuildKit's cache mounts keep the registry and target dir) and
# runs `hack/images.sh stage`, the same script that builds the images for the
# test node without Docker: each image below is that script's root filesystem
# (binaries plus the shared libraries they load), so the two paths cannot drift.
# `hack/images.sh check-dockerfile` (run by `make test`) checks ENTRYPOINT/USER/ENV.

ARG RUST_IMAGE=rust:1.95-bookworm

FROM ${RUST_IMAGE} AS build
RUN apt-get update -qq && apt-get install -y -qq busybox-static && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
      -p kubeshare-scheduler -p kubeshare-webhook -p kubeshare-node-daemon \
      -p gem-schd -p gemhook -p kubectl-sharedgpu -p fake-libcuda \
 && hack/images.sh stage /out extender webhook node-daemon workload \
 && install -D target/release/kubectl-sharedgpu /out/all/rootfs/usr/local/bin/kubectl-sharedgpu \
 && cp -a /out/extender/rootfs/. /out/webhook/rootfs/. /out/node-daemon/rootfs/. /out/all/rootfs/

# The scheduler extender (sidecar of the kubeshare-scheduler Deployment).
FROM scratch AS extender
COPY --from=build /out/extender/rootfs/ /
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kubeshare-extender"]

# The admission webhook.
FROM scratch AS webhook
COPY --from=build /out/webhook/rootfs/ /
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kubeshare-webhook"]

# The node daemon, with the gem-schd it runs per GPU and the hook it installs on
# the host for pods. Runs as root (the DaemonSet says so) to own /var/lib/kubeshare.
FROM scratch AS node-daemon
COPY --from=build /out/node-daemon/rootfs/ /
USER 0:0
ENTRYPOINT ["/usr/local/bin/kubeshare-node-daemon"]

# A CUDA workload on the fake driver (libcuda.so.1), with busybox: the test node's pods.
FROM scratch AS workload
COPY --from=build /out/workload/rootfs/ /
USER 0:0
ENV NVIDIA_VISIBLE_DEVICES=all
ENV PATH=/usr/local/bin:/bin
ENTRYPOINT ["/usr/local/bin/cuda-workload"]

# Everything, for bare-metal use and for `kubectl sharedgpu` in a toolbox pod.
FROM scratch AS all
COPY --from=build /out/all/rootfs/ /
