#!/bin/bash
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
git log --oneline -1 >> $OUT/gpu.txt
timeout 420 python benchmarks/report.py --profile link-fp8 --out $OUT > $OUT/link-fp8.log 2>&1
echo "link rc $?" >> $OUT/gpu.txt
cd benchmarks
timeout 60 python copy_launches.py > $OUT/copy_launches.txt 2>&1
echo "copy_launches rc $?" >> $OUT/gpu.txt
timeout 100 python step_timeline.py --routings oracle --budgets 1 --quantize fp8 > $OUT/timeline-olmoe-fp8.txt 2>&1
echo "timeline rc $?" >> $OUT/gpu.txt
