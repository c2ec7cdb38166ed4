"""Issue 74's registered queue (docs/extrapolation.md, "The headline at equal budget (issue 74)"), written from the
repo root with YaRN's step count N (the doubling rule), the lrs the search chose at N and the n of the power rule:

    python docs/runs/i74-registered-queue.py --n=5 --steps=7680 --yarn_lr=3e-4 --popeft_lr=3e-4
    # -> docs/runs/i74-registered.tsv

One block per seed (7401, 7402, ...: no other study's), in order: RoPE and PoPE pretraining (issue 60's registered
recipes, both lr 2e-3, min_lr 2e-4, the lrs chosen on validation; YaRN's search ran from RoPE parents at 1e-3, issue
60's caveat 1), then YaRN (ramp `code`) from that seed's RoPE run and PoPE+ft
from its PoPE run, both N steps at the same batch with the search's schedule (docs/runs/i74-search-queue.py: warmup
4 % of the steps rounded up, constant lr, evaluations every N / 16 steps). Every run is scored tiled at 256, 512,
1024, 2048 and 4096 over the whole test split (--max_tokens=0: every 4097-character chunk; --one_document: the split
read as one document, as issues 54 and 60 read it, though meta.json now declares its two works), the arms' table at
1x, 4x (H2c) and 16x (H2a, H2b: the primary, ppl at 4096).
"""

import argparse
import math

H = "\t"
SEED0 = 7401
ARMS = ("rope", "pope", "yarn", "popeft")


def after(out):
    """The registered evaluation: tiled at 1x-16x over the whole test split."""
    return (
        f"python eval_extrapolate.py {out} --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 "
        f"--max_tokens=0 --one_document --out_dir={out}/extrapolate --device=cpu"
    )


def args(arm, seed, steps, lr):
    """train.py's arguments of one arm's run at seed (lr: the fine-tune's; pretraining lrs are fixed)."""
    if arm == "rope":
        return f"--pos_encoding=rope --seed={seed} --learning_rate=2e-3 --min_lr=2e-4"
    if arm == "pope":
        return f"--seed={seed} --learning_rate=2e-3 --min_lr=2e-4"
    if arm == "yarn":
        head = f"config/finetune_shakespeare_char_yarn.py --rope_yarn_ramp=code --init_ckpt=out-i74/rope-s{seed}"
    else:
        head = f"config/finetune_shakespeare_char_pope.py --init_ckpt=out-i74/pope-s{seed}"
    warm, ev = math.ceil(0.04 * steps), steps // 16
    return (
        f"{head}/best.pt --seed={seed} --max_iters={steps} --lr_decay_iters={steps} --warmup_iters={warm} "
        f"--learning_rate={lr} --min_lr={lr} --eval_interval={ev} --log_interval={ev}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True, help="seeds per arm, from the registration's power rule")
    ap.add_argument("--steps", type=int, required=True, help="N, YaRN's step count (the doubling rule)")
    ap.add_argument("--yarn_lr", required=True, help="YaRN's lr at N, chosen on validation (1e-4, 3e-4 or 1e-3)")
    ap.add_argument("--popeft_lr", required=True, help="PoPE+ft's lr at N, chosen on validation")
    ap.add_argument("--out", default="docs/runs/i74-registered.tsv")
    a = ap.parse_args(argv)
    if a.n < 1 or a.steps < 16 or {a.yarn_lr, a.popeft_lr} - {"1e-4", "3e-4", "1e-3"}:
        raise SystemExit("--n >= 1, --steps >= 16, and each lr one of the search's: 1e-4, 3e-4, 1e-3")
    lr = {"rope": None, "pope": None, "yarn": a.yarn_lr, "popeft": a.popeft_lr}
    lines = []
    for s in range(SEED0, SEED0 + a.n):
        for arm in ARMS:
            name, out = f"i74-{arm}-s{s}", f"out-i74/{arm}-s{s}"
            lines.append(H.join((name, out, args(arm, s, a.steps, lr[arm]), after(out))))
    head = (
        '# issue 74, the registered comparison (docs/extrapolation.md, "The headline at equal budget"): seeds '
        f"{SEED0} .. {SEED0 + a.n - 1},\n# one block per seed in order. Arms: RoPE (lr 2e-3), PoPE (lr 2e-3), "
        f"YaRN ({a.steps} steps, lr {a.yarn_lr}, ramp code), PoPE+ft ({a.steps} steps, lr {a.popeft_lr}).\n"
        "# Every run scored tiled at 1x-16x over the whole test split. Written by docs/runs/i74-registered-queue.py\n"
        f"# --n={a.n} --steps={a.steps} --yarn_lr={a.yarn_lr} --popeft_lr={a.popeft_lr}. Two lanes, one core each:\n"
        f"#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh {a.out} > lane-i74-0.log 2>&1 &\n"
        f"#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh {a.out} > lane-i74-1.log 2>&1 &\n"
    )
    with open(a.out, "w") as f:
        f.write(head + "\n".join(lines) + "\n")
    print(f"wrote {a.out}: {len(lines)} runs")


if __name__ == "__main__":
    main()
