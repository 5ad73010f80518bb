# Local Kubernetes control plane for the integration tests (issue 3).
#   make k8s-binaries    build or reuse kube-apiserver & co. (hack/build-k8s.sh)
#   make cluster-up      start a cluster in $(CLUSTER_RUN_DIR); `. $(CLUSTER_RUN_DIR)/cluster.env`
#   make cluster-down    stop it
# `make test` runs `cargo test` through $(CARGO_TEST_WRAPPER), which brings one
# cluster up for the whole test run and always brings it down afterwards.

CLUSTER_RUN_DIR ?= $(CURDIR)/target/kubeshare-cluster
CARGO_TEST_WRAPPER := hack/with-cluster.sh

TEST_PREREQS += k8s-binaries

.PHONY: k8s-binaries cluster-up cluster-down

k8s-binaries:
	hack/build-k8s.sh

cluster-up: k8s-binaries
	hack/cluster.sh up $(CLUSTER_RUN_DIR)

cluster-down:
	hack/cluster.sh down $(CLUSTER_RUN_DIR)
