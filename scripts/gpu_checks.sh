#!/usr/bin/env bash
# Every GPU check of the project in one run, in parallel groups (one GPU, 16 CPU cores):
#   bash scripts/gpu_checks.sh OUT_DIR
#   GPU_CHECKS_GROUPS="fast1 attention" bash scripts/gpu_checks.sh OUT_DIR   # only some groups
# Groups: attention fast3 fast1 many engine engine_bf16 engine_graphs engine_more cli reference sanitizer notebooks
# (default: all; the engine tests run as three groups, the longest ones on their own).
# Writes OUT_DIR/<group>.log per group, OUT_DIR/summary.txt (the last lines of each log) and the page
# of the run, docs/benchmarks/gpu_checks.md (date, GPU, commit, passed / failed / skipped per group),
# also copied to OUT_DIR/gpu_checks.md.
# The commit comes from git, or from $INKLING_COMMIT where the tree has no .git.
# Notebooks under nbval need the wheels of ../shared/device/fetch-notebook-wheels.sh in .whl.
set -u
OUT=${1:?usage: gpu_checks.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
T=${GPU_CHECKS_TIMEOUT:-540}

ALL_GROUPS="attention fast3 fast1 many engine engine_bf16 engine_graphs engine_more cli reference sanitizer notebooks"
GROUPS_WANTED=" ${GPU_CHECKS_GROUPS:-$ALL_GROUPS} "

run() {  # run NAME THREADS CMD...
  local name=$1 threads=$2; shift 2
  [[ "$GROUPS_WANTED" == *" $name "* ]] || return 0
  ( export OMP_NUM_THREADS=$threads; start=$(date +%s)
    timeout "$T" "$@" >"$OUT/$name.log" 2>&1; rc=$?
    echo "[$name] rc=$rc in $(( $(date +%s) - start )) s" >>"$OUT/$name.log" ) &
}

run attention 2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_attention_decode.py \
                 tests/fast/test_attention_prefill.py tests/fast/test_attention_prep.py
run fast3     2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_lm_head_argmax.py \
                 tests/fast/test_accept.py tests/fast/test_rejection.py tests/fast/test_moe.py
run fast1     2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_embed_norm.py \
                 tests/fast/test_mtp_input.py tests/fast/test_rms_norm.py tests/fast/test_swiglu.py \
                 tests/fast/test_short_conv.py
run many      2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_moe_grouped.py \
                 tests/fast/test_lm_head_rows.py tests/fast/test_many_token_paths.py
run engine_more 2 python3 -m pytest -q -p no:cacheprovider tests/fast/test_compile_count.py \
                 tests/fast/test_warmup.py tests/fast/test_engine_draft_distribution.py tests/fast/test_engine_adaptive.py \
                 tests/fast/test_engine_auto.py tests/fast/test_engine_nonfinite.py tests/fast/test_port_dump_fast.py
ENGINE_LONG="bf16_equals or host_sync or device_uniforms or result_copies"
run engine    2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_engine.py -k "not ($ENGINE_LONG)"
run engine_bf16   2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_engine.py -k "bf16_equals"
run engine_graphs 2  python3 -m pytest -q -p no:cacheprovider tests/fast/test_engine.py -k "host_sync or device_uniforms or result_copies"
run cli       2  python3 -m pytest -q -p no:cacheprovider tests/test_cli.py
# the reference's GPU tests (its CPU tests are what CI runs)
run reference 4  python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/fast --ignore=tests/test_cli.py
# the scenario once plainly (it fills Triton's kernel cache, so that memcheck does not watch the compiler), then under memcheck
run sanitizer 1  bash -c "python3 scripts/sanitize_engine.py && compute-sanitizer --tool memcheck python3 scripts/sanitize_engine.py"
if [ -d .whl ] && [[ "$GROUPS_WANTED" == *" notebooks "* ]]; then
  ( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$PWD/.site" .whl/*.whl >/dev/null 2>&1
    export PYTHONPATH="$PWD/.site:$PYTHONPATH" OMP_NUM_THREADS=2; start=$(date +%s)
    timeout "$T" python3 -m pytest -q -p no:cacheprovider --nbval --nbval-current-env notebooks/ \
      >"$OUT/notebooks.log" 2>&1; rc=$?
    echo "[notebooks] rc=$rc in $(( $(date +%s) - start )) s" >>"$OUT/notebooks.log" ) &
fi
wait
for f in "$OUT"/*.log; do echo "== $f"; tail -n 4 "$f"; done | tee "$OUT/summary.txt"
COMMAND="${GPU_CHECKS_GROUPS:+GPU_CHECKS_GROUPS=\"$GPU_CHECKS_GROUPS\" }bash scripts/gpu_checks.sh OUT"
python3 scripts/gpu_checks_page.py "$OUT" "$COMMAND" docs/benchmarks/gpu_checks.md $ALL_GROUPS \
  && cp docs/benchmarks/gpu_checks.md "$OUT/gpu_checks.md"
