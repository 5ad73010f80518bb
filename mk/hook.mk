# libgemhook (hook/) and its test double (fake-libcuda/).
#
# The hook's integration tests (hook/tests/) preload target/debug/libgemhook.so into the
# fake-libcuda workload and talk to real gem-schd processes: build those first.

.PHONY: hook-prereqs hook-release hook-test

hook-prereqs:
	$(CARGO) build --locked -p gemhook -p fake-libcuda -p gem-schd
	ln -sf libgemhook.so target/debug/libgemhook.so.1
	mkdir -p target/debug/fake-cuda && ln -sf ../libfake_cuda.so target/debug/fake-cuda/libcuda.so.1

TEST_PREREQS += hook-prereqs

hook-test: hook-prereqs
	$(CARGO) test --locked -p gemhook

# Release artifacts for the GPU benchmarks (hack/gpu-bench.sh, hack/gpu/launch-cost-smi-kill.sh,
# hack/gpu/share.py), in a git-ignored folder; the fake driver and its workload are for the
# per-launch cost benchmark over the fake (hack/gpu/launch-cost-smi-kill.sh).
hook-release:
	$(CARGO) build --locked --release -p gemhook -p gem-schd -p fake-libcuda
	mkdir -p .device-carry/gemhook
	cp target/release/libgemhook.so .device-carry/gemhook/libgemhook.so.1
	cp target/release/gem-schd target/release/libfake_cuda.so target/release/cuda-workload .device-carry/gemhook/
