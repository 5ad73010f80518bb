# syntax=docker/dockerfile:1
# KubeShare's images, from one multi-stage build:
#   docker build --target extender    -t kubeshare/kubeshare-extender:latest .
#   docker build --target webhook     -t kubeshare/kubeshare-webhook:latest .
#   docker build --target node-daemon -t kubeshare/kubeshare-node-daemon:latest .
# (hack/kind-demo.sh builds all three.) The `build` stage compiles the whole
# workspace once; BuildKit's cache mounts keep the registry and target dir
# between builds.

ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
      -p kubeshare-scheduler -p kubeshare-webhook -p kubeshare-node-daemon \
      -p gem-schd -p gemhook -p kubectl-sharedgpu \
 && mkdir -p /out/bin /out/lib \
 && cp target/release/kubeshare-extender target/release/kubeshare-webhook \
       target/release/kubeshare-node-daemon target/release/gem-schd \
       target/release/kubectl-sharedgpu /out/bin/ \
 && cp target/release/libgemhook.so /out/lib/libgemhook.so.1

# The scheduler extender (sidecar of the kubeshare-scheduler Deployment).
FROM ${RUNTIME_IMAGE}:nonroot AS extender
COPY --from=build /out/bin/kubeshare-extender /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kubeshare-extender"]

# The admission webhook.
FROM ${RUNTIME_IMAGE}:nonroot AS webhook
COPY --from=build /out/bin/kubeshare-webhook /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kubeshare-webhook"]

# The node daemon, with the gem-schd it runs per GPU and the hook it installs on
# the host for pods. Runs as root (the DaemonSet says so) to own /var/lib/kubeshare.
FROM ${RUNTIME_IMAGE} AS node-daemon
COPY --from=build /out/bin/kubeshare-node-daemon /out/bin/gem-schd /usr/local/bin/
COPY --from=build /out/lib/libgemhook.so.1 /usr/local/lib/kubeshare/
ENTRYPOINT ["/usr/local/bin/kubeshare-node-daemon"]

# Everything, for bare-metal use and for `kubectl sharedgpu` in a toolbox pod.
FROM ${RUNTIME_IMAGE} AS all
COPY --from=build /out/bin/ /usr/local/bin/
COPY --from=build /out/lib/libgemhook.so.1 /usr/local/lib/kubeshare/
