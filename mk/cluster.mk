# Local Kubernetes control plane for the integration tests.
#   make k8s-binaries    build or reuse kube-apiserver & co. (hack/build-k8s.sh)
#   make cluster-up      start a cluster in $(CLUSTER_RUN_DIR); `. $(CLUSTER_RUN_DIR)/cluster.env`
#   make cluster-down    stop it
#   make bench-scale     pods/s and CPU per pod at 1,000 nodes, KubeShare profile vs the
#                        default one, side by side (hack/bench-scale.sh; docs/benchmarks.md)
# `make test` runs `cargo test` through $(CARGO_TEST_WRAPPER), which brings one
# cluster up for the whole test run and always brings it down afterwards.
#
# Kubernetes versions: K8S_VERSION picks the version the rig builds and runs
# (default: the oldest supported, hack/build-k8s.sh's pin). `make test` runs on it;
#   make k8s-newest-test   the cluster and real-node tests again on $(K8S_NEWEST)
# (.ci/run runs `make test` on $(K8S_NEWEST) only: two cold builds do not fit
# its 90 minutes; docs/control-plane.md has the timings).
K8S_NEWEST ?= v1.37.2

CLUSTER_RUN_DIR ?= $(CURDIR)/target/kubeshare-cluster
CARGO_TEST_WRAPPER := hack/with-cluster.sh

TEST_PREREQS += k8s-binaries

.PHONY: k8s-binaries cluster-up cluster-down k8s-newest-test bench-scale

k8s-binaries:
	hack/build-k8s.sh

cluster-up: k8s-binaries
	hack/cluster.sh up $(CLUSTER_RUN_DIR)

cluster-down:
	hack/cluster.sh down $(CLUSTER_RUN_DIR)

BENCH_ROUNDS ?= 2
bench-scale:
	hack/bench-scale.sh $(BENCH_ROUNDS)

k8s-newest-test:
	$(MAKE) cargo-test node-test K8S_VERSION=$(K8S_NEWEST)
