# Node daemon. Its integration tests run the real gem-schd and the real scheduler
# extender next to kubeshare-node-daemon, and load the fake driver as NVML; build them
# before `cargo test`.

.PHONY: node-daemon-bins

TEST_PREREQS += node-daemon-bins

node-daemon-bins:
	$(CARGO) build --locked -p gem-schd -p kubeshare-scheduler -p kubeshare-node-daemon -p fake-libcuda
