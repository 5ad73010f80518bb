# The real node (issue 12): a kubelet with containerd on this machine, KubeShare
# deployed on it from manifests/, and the tests of testkit/tests/real_node.rs.
#   make node-images   release binaries -> OCI archives in target/images (hack/images.sh)
#   make node-test     a cluster + node (hack/with-cluster.sh --node), the real-node tests
# `make test` runs node-test last. Needs root, containerd, runc, umoci, busybox-static,
# the CNI plugins, iptables, conntrack (.ci/run installs what is missing). See docs/node.md.

.PHONY: images-check node-release node-images node-test

# The Dockerfile and hack/images.sh build the same images.
TEST_PREREQS += images-check

images-check:
	hack/images.sh check-dockerfile

node-release:
	$(CARGO) build --release --locked -p kubeshare-scheduler -p kubeshare-webhook \
	  -p kubeshare-node-daemon -p gem-schd -p gemhook -p fake-libcuda

node-images: node-release k8s-binaries
	hack/images.sh build

node-test: node-images
	hack/with-cluster.sh --node $(CARGO) test --locked -p kubeshare-testkit --test real_node \
	  -- --ignored --test-threads=1

# In `make test`, after everything else (make merges this into the Makefile's list).
ifneq ($(filter test,$(MAKECMDGOALS)),)
node-test: | fmt-check clippy cargo-test
endif
test: node-test
