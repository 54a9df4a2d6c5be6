#!/usr/bin/env bash
# Everything that needs the GPU, in one go, with no network: the GPU tests, the standalone
# program (three tiny steps: the first eager, choosing each product's algorithm and saying
# which, the others replaying its CUDA graph; its losses beside the NumPy run's) and under
# compute-sanitizer (memcheck and racecheck, two steps: one eager, one replayed), the same for
# the attention forward on wgmma, TMA and mbarrier (cgAttentionHopper 1), Hopper's twins against
# the hardware (scripts/hopper_twins_on_gpu.py), the benchmark; a summary table
# last. Meant for the lent H200 machine (8 minutes at most).
#
# That machine has CuPy, PyTorch, nvcc and compute-sanitizer but not lark: carry it as a
# wheel, fetched here beforehand with
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl lark
# and name .whl in the device call's carry list.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ! python3 -c "import lark" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/cgc-site .whl/lark-*.whl || exit 1
  export PYTHONPATH="/tmp/cgc-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/cgc-gpu-check}"
mkdir -p "$out"
declare -A status

echo "== GPU tests"
timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
status[gpu_tests]=${PIPESTATUS[0]}

echo "== standalone program: algorithms chosen, the graph replayed, then under compute-sanitizer"
python3 -m cgc run schedules/train.cg --backend numpy --config tiny --steps 3 --dump "$out/dump" \
  | tee "$out/numpy.log" | tail -1
python3 -m cgc compile schedules/train.cg --config tiny -o "$out/train.tiny.cu" 2>/dev/null
if python3 -c "import sys; from cgc.backends.cuda.toolchain import nvcc_build; ok, log = nvcc_build(sys.argv[1], sys.argv[2]); print(log); sys.exit(0 if ok else 1)" "$out/train.tiny.cu" "$out/train" >"$out/nvcc.log" 2>&1; then
  CG_ALGORITHM_REPORT=1 timeout 60 "$out/train" "$out/dump" 3 >"$out/standalone.log" 2>&1
  status[standalone]=$?
  cat "$out/standalone.log"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 "$out/train" "$out/dump" 2 \
      >"$out/$tool.log" 2>&1
    status[$tool]=$?
    tail -3 "$out/$tool.log"
  done
else
  cat "$out/nvcc.log"; status[standalone]=nvcc; status[memcheck]=nvcc; status[racecheck]=nvcc
fi

echo "== the attention forward on wgmma, TMA and mbarrier (--set cgAttentionHopper=1): standalone, memcheck, racecheck"
python3 -m cgc compile schedules/train.cg --config tiny --set cgAttentionHopper=1 -o "$out/train.hopper.cu" 2>/dev/null
if python3 -c "import sys; from cgc.backends.cuda.toolchain import nvcc_build; ok, log = nvcc_build(sys.argv[1], sys.argv[2]); print(log); sys.exit(0 if ok else 1)" "$out/train.hopper.cu" "$out/train-hopper" >"$out/nvcc-hopper.log" 2>&1; then
  timeout 60 "$out/train-hopper" "$out/dump" 3 >"$out/standalone-hopper.log" 2>&1
  status[hopper]=$?
  cat "$out/standalone-hopper.log"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 "$out/train-hopper" "$out/dump" 2 \
      >"$out/$tool-hopper.log" 2>&1
    status[hopper_$tool]=$?
    tail -3 "$out/$tool-hopper.log"
  done
else
  cat "$out/nvcc-hopper.log"; status[hopper]=nvcc; status[hopper_memcheck]=nvcc; status[hopper_racecheck]=nvcc
fi

echo "== Hopper's twins against the hardware (wgmma, TMA, the driver's tensor maps)"
timeout 180 python3 scripts/hopper_twins_on_gpu.py 2>&1 | tee "$out/hopper-twins.log"
status[hopper_twins]=${PIPESTATUS[0]}

echo "== benchmark"
timeout 240 python3 scripts/bench_gpu.py 2>&1 | tee "$out/bench.log"
status[bench]=${PIPESTATUS[0]}

echo
echo "== summary (0 = passed)"
printf '%-12s %s\n' "check" "status"
for check in gpu_tests standalone memcheck racecheck hopper hopper_memcheck hopper_racecheck hopper_twins bench; do
  printf '%-12s %s\n' "$check" "${status[$check]}"
done
tail -4 "$out/bench.log"
