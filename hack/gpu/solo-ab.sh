# Sourced by hack/gpu's launch A/B scripts (busy-check.sh, launch-parts.sh): with $art (the
# hook and gem-schd), $out and $here set, records the GPU in $out/gpu.txt, compiles
# launch_ab.cu into a fresh $work, and starts gem-schd for the GPU with one client `solo` at
# 1.0 (its sockets under $work/pods/solo; SCHD_ARGS adds arguments). The caller's EXIT trap
# kills "${pids[@]}" and removes $work.
work=$(mktemp -d); pids=(); trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nvcc -O2 -o "$work/launch_ab" "$here/launch_ab.cu" -lcuda || exit 1
U=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
printf '1\nsolo 1.0 1.0 4294967296\n' >"$work/rc.txt"
# shellcheck disable=SC2086 # SCHD_ARGS is a list of words
"$art/gem-schd" --gpu "$U" --config "$work/rc.txt" --socket-template "$work/pods/{client}/{gpu}.sock" \
  --quiet-ms 0 ${SCHD_ARGS:-} 2>"$work/schd.log" &
pids+=($!); sleep 0.5
