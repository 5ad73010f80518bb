# Admission webhook. Nothing is needed before `cargo test`: the
# integration test runs the webhook in-process against the shared test cluster.
#   make webhook-bench   admission latency under load (figures: docs/benchmarks.md)

.PHONY: webhook-bench

webhook-bench:
	webhook/bench.sh
