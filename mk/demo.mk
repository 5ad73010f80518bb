# The local demo: no GPU, no Docker.
#   make demo        build, start a local control plane + KubeShare, run examples/, print the table
#   make demo-down   stop everything the demo started
# KUBESHARE_DEMO_DIR (default /tmp/kubeshare-demo) holds logs, pids and kubeconfigs.

.PHONY: demo demo-down

demo:
	hack/demo.sh

demo-down:
	hack/demo-down.sh
