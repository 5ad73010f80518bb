# Host packages the tests need (the control plane's tools, the real node's containerd,
# runc, CNI plugins, umoci, busybox-static ...): `make host-prereqs` installs the missing
# ones with apt-get, or, when not root, names the command to run as root and fails.
# .ci/run calls the same target. See README, "What the tests need from the host".

.PHONY: host-prereqs

host-prereqs:
	hack/host-prereqs.sh

TEST_PREREQS += host-prereqs

# In `make test`, every step waits for it, also under `make -j` (only there: `make demo`
# needs none of the real node's packages).
ifneq ($(filter test,$(MAKECMDGOALS)),)
fmt-check clippy prereqs cargo-test node-test node-images node-bins: | host-prereqs
endif
