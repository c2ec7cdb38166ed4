"""Issue 74's search queues after the step count (docs/extrapolation.md, "The headline at equal budget (issue 74)"),
written from the repo root once YaRN's step count N is read off the doubling rule:

    python docs/runs/i74-search-queue.py --n=3840            # -> docs/runs/i74-search-n3840.tsv
    python docs/runs/i74-search-queue.py --n=7680 --center   # N set by the cap: 3e-4 at N has not run yet
    python docs/runs/i74-search-queue.py --n=7680 --extend=yarn:3e-3   # the edge rule's one step past a win at 1e-3
    # -> docs/runs/i74-search-n7680-yarn-lr3e-3.tsv (the two seeds' lines; run after the search's queue)

Two blocks, validation only, the search's seeds (6001, 6002):
- YaRN at N steps, lr one step down and up from the searched 3e-4 (1e-4, 1e-3), ramp `code`, from the search's
  RoPE parents (lr 1e-3, i74s-rope-sS: issue 60's i60s-rope-sS retrained to the bit); with --center also at 3e-4
  itself, first in the queue (N = 7680 is reached by the rule's cap, not by a doubling that ran);
- PoPE+ft at N steps (config/finetune_shakespeare_char_pope.py) at lr 1e-4, 3e-4 and 1e-3, from PoPE parents at
  the registered PoPE lr (2e-3, min_lr 2e-4: issue 60's i60s-pope-lr2e-3-sS retrained).
Both fine-tunes: warmup 4 % of the steps rounded up, constant lr, evaluations every N / 16 steps.
--extend=ARM:LR writes only the edge rule's extension (docs/extrapolation.md, the amendment of issue 74's rules):
ARM yarn or popeft, LR 3e-5 (one step below a win at 1e-4) or 3e-3 (above a win at 1e-3), on the same seeds.
"""

import argparse
import math

SEEDS = (6001, 6002)
H = "\t"
EDGES = ("3e-5", "3e-3")  # the grid's one step past 1e-4 and past 1e-3


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
    ap.add_argument(
        "--extend",
        metavar="ARM:LR",
        help="only the edge rule's extension: ARM yarn or popeft, LR 3e-5 or 3e-3 (the two seeds' lines)",
    )
    args = ap.parse_args(argv)
    n = args.n
    if args.extend is not None:
        arm, _, lr = args.extend.partition(":")
        if arm not in ("yarn", "popeft") or lr not in EDGES or args.center:
            raise SystemExit(
                f"--extend=ARM:LR with ARM yarn or popeft and LR 3e-5 or 3e-3 (the edge rule's one step past "
                f"1e-4 or 1e-3), without --center; got {args.extend!r}"
            )
        path = f"docs/runs/i74-search-n{n}-{arm}-lr{lr}.tsv"
        head = f"""# issue 74, the edge rule's extension at N = {n} steps (validation only; by i74-search-queue.py
# --n={n} --extend={args.extend}): {arm} at lr {lr} on the search's seeds.
# Run after docs/runs/i74-search-n{n}.tsv, in its worktree (its parents), two lanes, one core each:
#   Q="docs/runs/i74-search-n{n}.tsv {path}"
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh $Q > lane-i74-0.log 2>&1 &
#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh $Q > lane-i74-1.log 2>&1 &
"""
        lines = [finetune(arm, n, lr, s) for s in SEEDS]
        with open(path, "w") as f:
            f.write(head + "\n".join(lines) + "\n")
        print(f"wrote {path}: {len(lines)} runs")
        return
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
