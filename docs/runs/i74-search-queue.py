"""Issue 74's search queues after the step count (docs/extrapolation.md, "The headline at equal budget (issue 74)"),
written from the repo root once YaRN's step count N is read off the doubling rule:

    python docs/runs/i74-search-queue.py --n=3840            # -> docs/runs/i74-search-n3840.tsv
    python docs/runs/i74-search-queue.py --n=7680 --center   # N set by the cap: 3e-4 at N has not run yet

Two blocks, validation only, the search's seeds (6001, 6002):
- YaRN at N steps, lr one step down and up from the searched 3e-4 (1e-4, 1e-3), ramp `code`, from the search's
  RoPE parents (lr 1e-3, i74s-rope-sS: issue 60's i60s-rope-sS retrained to the bit); with --center also at 3e-4
  itself, first in the queue (N = 7680 is reached by the rule's cap, not by a doubling that ran);
- PoPE+ft at N steps (config/finetune_shakespeare_char_pope.py) at lr 1e-4, 3e-4 and 1e-3, from PoPE parents at
  the registered PoPE lr (2e-3, min_lr 2e-4: issue 60's i60s-pope-lr2e-3-sS retrained).
Both fine-tunes: warmup 4 % of the steps rounded up, constant lr, evaluations every N / 16 steps.
"""

import argparse
import math

SEEDS = (6001, 6002)
H = "\t"


def finetune(kind, n, lr, seed):
    """One queue line: a YaRN or PoPE+ft fine-tune of n steps at lr from seed's search parent."""
    warm, ev = math.ceil(0.04 * n), n // 16
    if kind == "yarn":
        head = f"config/finetune_shakespeare_char_yarn.py --rope_yarn_ramp=code --init_ckpt=out-i74s/rope-s{seed}"
        tag = f"yarn-n{n}-lr{lr}-code-s{seed}"
    else:
        head = f"config/finetune_shakespeare_char_pope.py --init_ckpt=out-i74s/pope-lr2e-3-s{seed}"
        tag = f"popeft-n{n}-lr{lr}-s{seed}"
    args = (
        f"{head}/best.pt --seed={seed} --max_iters={n} --lr_decay_iters={n} --warmup_iters={warm} "
        f"--learning_rate={lr} --min_lr={lr} --eval_interval={ev} --log_interval={ev}"
    )
    return H.join((f"i74s-{tag}", f"out-i74s/{tag}", args))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True, help="YaRN's step count N, read off the doubling rule")
    ap.add_argument("--center", action="store_true", help="also YaRN at the searched lr 3e-4 (not yet run at N)")
    args = ap.parse_args(argv)
    n = args.n
    yarn_lrs = "1e-4, 3e-4, 1e-3" if args.center else "1e-4, 1e-3 beside the searched 3e-4"
    head = f"""# issue 74, the search at N = {n} steps (validation only; by i74-search-queue.py --n={n}):
# YaRN's lr at N ({yarn_lrs}) and PoPE+ft's lr (1e-4, 3e-4, 1e-3),
# on the search's seeds.
# Run in the worktree that ran docs/runs/i74-yarn-3840.tsv (its RoPE parents), two lanes, one core each:
#   Q="docs/runs/i74-yarn-3840.tsv docs/runs/i74-search-n{n}.tsv"
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh $Q > lane-i74-0.log 2>&1 &
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh $Q > lane-i74-1.log 2>&1 &
"""
    lines = [finetune("yarn", n, "3e-4", s) for s in SEEDS] if args.center else []
    lines += [
        H.join(
            (f"i74s-pope-lr2e-3-s{s}", f"out-i74s/pope-lr2e-3-s{s}", f"--seed={s} --learning_rate=2e-3 --min_lr=2e-4")
        )
        for s in SEEDS
    ]
    for s in SEEDS:
        lines += [finetune("yarn", n, lr, s) for lr in ("1e-4", "1e-3")]
        lines += [finetune("popeft", n, lr, s) for lr in ("1e-4", "3e-4", "1e-3")]
    path = f"docs/runs/i74-search-n{n}.tsv"
    with open(path, "w") as f:
        f.write(head + "\n".join(lines) + "\n")
    print(f"wrote {path}: {len(lines)} runs")


if __name__ == "__main__":
    main()
