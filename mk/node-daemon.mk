# Node daemon. Its integration test runs the real gem-schd and the real
# scheduler extender next to kubeshare-node-daemon; build them before `cargo test`.

.PHONY: node-daemon-bins

TEST_PREREQS += node-daemon-bins

node-daemon-bins:
	$(CARGO) build --locked -p gem-schd -p kubeshare-scheduler -p kubeshare-node-daemon --bins
