#!/bin/bash
export PYTHONPATH=$PWD
timeout 240 python ab/budget.py fp8 > $OUT/budget-fp8.log 2>&1
echo "budget rc $?" >> $OUT/rc.txt
timeout 340 python benchmarks/report.py --profile link-fp8 --out $OUT > $OUT/link-fp8.log 2>&1
echo "link rc $?" >> $OUT/rc.txt
