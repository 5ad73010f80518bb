# KubeShare in Rust: top-level entry points.
#   make test   - format check, clippy (warnings are errors), every test
#   make demo   - the local demo (see README)
#
# Each part of the project may add its own steps in mk/<part>.mk:
#   TEST_PREREQS += <target>   things `make test` needs before `cargo test`
# so that parts never edit the same lines of this file.

CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

TEST_PREREQS :=
# A command that wraps `cargo test` (mk/cluster.mk brings a shared cluster up around it).
CARGO_TEST_WRAPPER :=

# Host packages first (mk/host.mk): the steps after it need them. Named before the
# parts' own additions to `test` (mk/node.mk adds node-test), so a serial make runs it
# first; mk/host.mk orders the rest after it under `make -j` too.
test: host-prereqs

-include mk/*.mk

.PHONY: test fmt-check clippy cargo-test prereqs

test: fmt-check clippy prereqs cargo-test

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

prereqs: $(TEST_PREREQS)

cargo-test: prereqs
	$(CARGO_TEST_WRAPPER) $(CARGO) test --workspace --locked
