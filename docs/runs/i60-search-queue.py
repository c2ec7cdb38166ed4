"""Issue 60's search queues (docs/extrapolation.md, "The search (issue 60)"), written from the repo root:

    python docs/runs/i60-search-queue.py    # -> docs/runs/i60-search.tsv, -960.tsv, -rope-lr.tsv

YaRN: warmup 4 % of the steps rounded up (the 15-step recipe's 1 step), constant lr (min_lr = learning_rate), about
8 evaluations per run. DroPE: its config's schedule (warmup 10 %, cosine to 0). PoPE: min_lr a tenth of the lr.
"""

import math

SEEDS = (6001, 6002)
H = "\t"


def yarn(n, lr, ramp, seed):
    warm = math.ceil(0.04 * n)
    ev = {15: 5, 60: 10, 240: 30, 960: 120}[n]
    name = f"i60s-yarn-n{n}-lr{lr}-{ramp}-s{seed}"
    args = (
        f"config/finetune_shakespeare_char_yarn.py --seed={seed} --init_ckpt=out-i60s/rope-s{seed}/best.pt "
        f"--rope_yarn_ramp={ramp} --max_iters={n} --lr_decay_iters={n} --warmup_iters={warm} "
        f"--learning_rate={lr} --min_lr={lr} --eval_interval={ev} --log_interval={ev}"
    )
    return H.join((name, f"out-i60s/yarn-n{n}-lr{lr}-{ramp}-s{seed}", args))


def drope(n, lr, seed):
    warm = math.ceil(0.1 * n)
    ev = {60: 20, 240: 30, 1500: 100}[n]
    name = f"i60s-drope-n{n}-lr{lr}-s{seed}"
    args = (
        f"config/finetune_shakespeare_char_drope.py --seed={seed} --init_ckpt=out-i60s/rope-s{seed}/best.pt "
        f"--max_iters={n} --lr_decay_iters={n} --warmup_iters={warm} --learning_rate={lr} --eval_interval={ev} "
        f"--log_interval={min(ev, 50)}"
    )
    return H.join((name, f"out-i60s/drope-n{n}-lr{lr}-s{seed}", args))


def pope(lr, seed):
    name = f"i60s-pope-lr{lr}-s{seed}"
    min_lr = f"{float(lr) / 10:.0e}".replace("e-0", "e-")  # a tenth, as the default 1e-3 -> 1e-4
    return H.join((name, f"out-i60s/pope-lr{lr}-s{seed}", f"--seed={seed} --learning_rate={lr} --min_lr={min_lr}"))


def rope(lr, seed):
    name = f"i60s-rope-lr{lr}-s{seed}"
    min_lr = f"{float(lr) / 10:.0e}".replace("e-0", "e-")
    args = f"--pos_encoding=rope --seed={seed} --learning_rate={lr} --min_lr={min_lr}"
    return H.join((name, f"out-i60s/rope-lr{lr}-s{seed}", args))


HEAD = """# issue 60, the search (docs/extrapolation.md, "The search (issue 60)"): validation only, never test;
# seeds 6001, 6002 (kept out of every registered run). Block order: the two RoPE parents (one per lane), then per
# seed the YaRN grid (15 / 60 / 240 steps x lr 1e-4, 3e-4 x ramp code, paper) and the DroPE grid (60 / 240 / 1500
# steps x lr 3e-4, 1e-3), then PoPE's pretraining lr (5e-4, 1e-3, 2e-3). No after-command: the choice reads
# metrics.json's val loss.
# Written by docs/runs/i60-search-queue.py. Two lanes, one core each:
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh docs/runs/i60-search.tsv > lane-i60s-0.log 2>&1 &
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh docs/runs/i60-search.tsv > lane-i60s-1.log 2>&1 &
"""
lines = [H.join((f"i60s-rope-s{s}", f"out-i60s/rope-s{s}", f"--pos_encoding=rope --seed={s}")) for s in SEEDS]
for s in SEEDS:
    lines += [yarn(n, lr, ramp, s) for n in (15, 60, 240) for lr in ("1e-4", "3e-4") for ramp in ("code", "paper")]
    lines += [drope(n, lr, s) for n in (60, 240, 1500) for lr in ("3e-4", "1e-3")]
lines += [pope(lr, s) for lr in ("5e-4", "1e-3", "2e-3") for s in SEEDS]
open("docs/runs/i60-search.tsv", "w").write(HEAD + "\n".join(lines) + "\n")

HEADROPE = """# issue 60, the search's RoPE lr block (docs/extrapolation.md, "An amendment: RoPE's pretraining
# lr"): RoPE, the parent of YaRN, gets PoPE's lr search (5e-4, 2e-3; 1e-3 is the parents above) at the same seeds
# and rule. Run after i60-search.tsv, before the 960 block, two lanes (one core each) of:
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh docs/runs/i60-search.tsv \\
#       docs/runs/i60-search-rope-lr.tsv docs/runs/i60-search-960.tsv > lane-i60s-N.log 2>&1 &
"""
lines = [rope(lr, s) for lr in ("5e-4", "2e-3") for s in SEEDS]
open("docs/runs/i60-search-rope-lr.tsv", "w").write(HEADROPE + "\n".join(lines) + "\n")

HEAD960 = """# issue 60, the search's 960-step YaRN block: run ONLY if docs/extrapolation.md's rule says so (the best
# 240-step setting's mean val loss at 1024 is more than 0.01 nats below the best 60-step one's), after i60-search.tsv:
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh docs/runs/i60-search-960.tsv > lane-i60s960-0.log 2>&1 &
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh docs/runs/i60-search-960.tsv > lane-i60s960-1.log 2>&1 &
"""
lines = [yarn(960, lr, ramp, s) for s in SEEDS for lr in ("1e-4", "3e-4") for ramp in ("code", "paper")]
open("docs/runs/i60-search-960.tsv", "w").write(HEAD960 + "\n".join(lines) + "\n")
