# The Helm chart (charts/kubeshare) and manifests/ rendered from it.
#   make helm          build or reuse helm (hack/build-helm.sh, from Go modules)
#   make manifests     render manifests/ from the chart
#   make chart-test    lint, manifests/ in sync, certificates, server-side dry run
# `make test` runs chart-test before `cargo test`.

.PHONY: helm manifests chart-test

TEST_PREREQS += chart-test

helm:
	hack/build-helm.sh

manifests: helm
	hack/render-manifests.sh

chart-test: helm k8s-binaries
	hack/with-cluster.sh hack/chart-test.sh
