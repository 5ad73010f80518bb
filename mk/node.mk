# The real node: a kubelet with containerd on this machine, KubeShare
# deployed on it from manifests/, and the tests of testkit/tests/real_node.rs.
#   make node-images   binaries -> OCI archives in target/images (hack/images.sh)
#   make node-test     a cluster + node (hack/with-cluster.sh --node), the real-node tests
# `make test` runs node-test last, on a node whose containerd gives GPUs through CDI.
# Needs root, containerd, runc, umoci, busybox-static,
# the CNI plugins, iptables, conntrack (`make host-prereqs` installs what is missing). See docs/node.md.

.PHONY: images-check node-bins node-images node-test node-containerd

# The Dockerfile and hack/images.sh build the same images.
TEST_PREREQS += images-check

images-check:
	hack/images.sh check-dockerfile

# Which cargo profile the images are built from. `make test` uses the debug build
# it makes anyway (stripped of debug info in the images): a second, release build
# of the same crates would cost ~10 min of the 2-core budget. The Dockerfile and
# `make node-images NODE_IMAGES_PROFILE=release` use release.
NODE_IMAGES_PROFILE ?= debug
NODE_CARGO_PROFILE_FLAG := $(if $(filter release,$(NODE_IMAGES_PROFILE)),--release,)

node-bins:
	$(CARGO) build $(NODE_CARGO_PROFILE_FLAG) --locked -p kubeshare-scheduler -p kubeshare-webhook \
	  -p kubeshare-node-daemon -p gem-schd -p gemhook -p fake-libcuda

node-images: node-bins k8s-binaries
	KUBESHARE_IMAGES_PROFILE=$(NODE_IMAGES_PROFILE) hack/images.sh build

# The node runs containerd 2.x with CDI (hack/node.sh; KUBESHARE_NODE_CDI=0 runs the host's
# containerd 1.6 instead): built from Go modules when missing (~3.5 min cold on 2 cores),
# cached in ~/.cache/kubeshare/containerd-<version>, before the cluster is up.
KUBESHARE_NODE_CDI ?= 1
export KUBESHARE_NODE_CDI
node-containerd:
	$(if $(filter 0,$(KUBESHARE_NODE_CDI)),@true,hack/build-containerd.sh)

node-test: node-images node-containerd
	KUBESHARE_IMAGES_PROFILE=$(NODE_IMAGES_PROFILE) hack/with-cluster.sh --node $(CARGO) test --locked -p kubeshare-testkit --test real_node \
	  -- --ignored --test-threads=1

# In `make test`, after everything else (make merges this into the Makefile's list).
ifneq ($(filter test,$(MAKECMDGOALS)),)
node-test: | fmt-check clippy cargo-test
endif
test: node-test
