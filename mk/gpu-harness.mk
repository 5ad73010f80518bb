# The GPU harness (hack/gpu, run on a GPU machine by hack/gpu-bench.sh): its analysis of what the
# tenants and gem-schd recorded is checked here without a GPU, in `make test`.

.PHONY: harness-test

harness-test:
	hack/gpu/harness-test.sh

TEST_PREREQS += harness-test
