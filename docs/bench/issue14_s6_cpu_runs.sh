#!/bin/bash
# docs/BENCHMARKS.md "Issue 14, session 6": the CPU runs of `bench decode` on the small preset.
# usage: issue14_s6_cpu_runs.sh MODE OUT
#   MODE=ab: before/after interleaved (B1 B1 B8 B8 B8 B8 B1 B1, trees alternating), random caches
#   MODE=official: the official command (prefill), this branch, B1 B8 B8 B1; bundled BLAS, then OpenBLAS x1
# Trees: before = `git archive 51ce754` unpacked at /tmp/br-before, after = this branch's code at
# /tmp/br-after, each run through a tessera/ symlink folder (README) at /tmp/br-{before,after}-ts.
cd /tmp
OB=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
MODE=$1; OUT=$2
run() { # tree batch blas fill
  local tree=$1 batch=$2 blas=$3 fill=$4 pp
  if [ $tree = before ]; then pp=/tmp/br-before-ts; else pp=/tmp/br-after-ts; fi
  local load=$(cut -d' ' -f1 /proc/loadavg)
  local line
  if [ $blas = openblas ]; then
    line=$(OPENBLAS_NUM_THREADS=1 LD_PRELOAD=$OB PYTHONPATH=$pp /work/venv/bin/python -m tessera.engine.tools.commands bench decode --model /tmp/small-batchrows --ctx 2048 --chunk 1024 --tile 256 --batch $batch --steps 8 --cache-fill $fill --json)
  else
    line=$(PYTHONPATH=$pp /work/venv/bin/python -m tessera.engine.tools.commands bench decode --model /tmp/small-batchrows --ctx 2048 --chunk 1024 --tile 256 --batch $batch --steps 8 --cache-fill $fill --json)
  fi
  echo "{\"tree\": \"$tree\", \"blas\": \"$blas\", \"load_avg_1m_before\": $load, \"result\": $line}" >> $OUT
}
for blas in bundled openblas; do
  if [ $MODE = official ]; then
    for b in 1 8 8 1; do run after $b $blas prefill; done
  else
    for pair in "before 1" "after 1" "before 8" "after 8" "after 8" "before 8" "after 1" "before 1"; do run $pair $blas random; done
  fi
done
echo done >> $OUT.done
