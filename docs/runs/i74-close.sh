#!/bin/bash
# issue 74's registered analysis, run once when all 20 records were in (OMP 1 thread each); its outputs, as printed:
# docs/runs/i74-result-outputs.txt. The commands are the registration's (ANALYSIS in i74-registered-queue.py), plus
# PoPE vs PoPE+ft (no verdict), the figure and --cpu. Usage: bash docs/runs/i74-close.sh [OUT_DIR]
set -e
cd "$(dirname "$0")/../.."
n=$(ls docs/runs/i74-{rope,yarn,pope,popeft}-s74*.json | wc -l); [ "$n" = 20 ] || { echo "only $n records"; exit 1; }
o=${1:-/tmp/i74-close-out}; mkdir -p "$o"; A=block_size,eval_interval,learning_rate,log_interval,lr_decay_iters,max_iters,min_lr,rope_original_block_size,rope_scaling,rope_yarn_ramp,warmup_iters
L=4096,256,512,1024,2048
export OMP_NUM_THREADS=1
python docs/runs/i74-registered-queue.py --verdicts > $o/verdicts.txt 2>&1
python study/results.py docs/runs/i74-*-s*.json --by=pos_encoding,block_size --extrapolation=$L > $o/table.txt 2>&1
python study/results.py docs/runs/i74-pope-s*.json docs/runs/i74-yarn-s*.json --compare=pos_encoding --decide=perm --allow=$A --extrapolation=$L > $o/h2a.txt 2>&1
python study/results.py docs/runs/i74-popeft-s*.json docs/runs/i74-yarn-s*.json --compare=pos_encoding --decide=perm --allow=$A --extrapolation=$L --tost=0.05 > $o/h2b_h2c.txt 2>&1
python study/results.py docs/runs/i74-rope-s*.json docs/runs/i74-pope-s*.json --compare=pos_encoding --extrapolation=$L > $o/rope_pope.txt 2>&1
python study/results.py docs/runs/i74-pope-s*.json docs/runs/i74-popeft-s*.json --compare=block_size --allow=$A --extrapolation=$L > $o/pope_popeft.txt 2>&1 || true
python docs/runs/i54-report.py --prefix=i74 --png=assets/extrapolation_i74_cpu.png > $o/report.txt 2>&1
python docs/runs/i74-registered-queue.py --cpu > $o/cpu.txt 2>&1
echo done
