"""Issue 60's registered queue (docs/extrapolation.md, "The registration (issue 60)"), written from the repo root
with the recipes the search chose and the n its rule set:

    python docs/runs/i60-registered-queue.py --n=8 --pope_lr=1e-3 [--rope_lr=2e-3] --yarn=240,3e-4,code \
        [--yarn_code=240,3e-4] [--drope=1500,1e-3]    # -> docs/runs/i60-registered.tsv

One block per seed (6101, 6102, ...), in order: RoPE and PoPE (the two long runs, one per lane), then from that
seed's RoPE run the chosen YaRN fine-tune (and, where the choice is the paper's ramp, the best `code` setting of the
same length as a secondary arm, --yarn_code), then DroPE if it recovered in the search (--drope). Every run is scored
as issue 54's were: tiled at 256-4096 over the same 16 test chunks (the primary: ppl at 4096) and sliding at 4096.
The fine-tunes' schedules are the search's (docs/runs/i60-search-queue.py): YaRN warmup 4 % rounded up, constant lr;
DroPE warmup 10 %, its config's cosine to 0; PoPE min_lr a tenth of its lr.
"""

import argparse
import math

H = "\t"
SEED0 = 6101


def after(out, name):
    """Issue 54's two evaluations: tiled 1x-16x (16 chunks of 4097 test characters) and sliding at 16x."""
    return (
        f"python eval_extrapolate.py {out} --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 "
        f"--max_tokens=65536 --out_dir={out}/extrapolate --device=cpu && python eval_extrapolate.py {out} "
        f"--dataset=shakespeare_char --lengths=4096 --protocol=sliding --max_tokens=32768 --out_dir={out}/sliding "
        f"--device=cpu && cp {out}/sliding/extrapolation.csv docs/runs/{name}.sliding.csv"
    )


def line(arm, seed, args):
    name, out = f"i60-{arm}-s{seed}", f"out-i60/{arm}-s{seed}"
    return H.join((name, out, args, after(out, name)))


def yarn_args(seed, n, lr, ramp):
    ev = {15: 5, 60: 10, 240: 30, 960: 120}[n]  # the search's
    return (
        f"config/finetune_shakespeare_char_yarn.py --seed={seed} --init_ckpt=out-i60/rope-s{seed}/best.pt "
        f"--rope_yarn_ramp={ramp} --max_iters={n} --lr_decay_iters={n} --warmup_iters={math.ceil(0.04 * n)} "
        f"--learning_rate={lr} --min_lr={lr} --eval_interval={ev} --log_interval={ev}"
    )


def drope_args(seed, n, lr):
    ev = {60: 20, 240: 30, 1500: 100}[n]
    return (
        f"config/finetune_shakespeare_char_drope.py --seed={seed} --init_ckpt=out-i60/rope-s{seed}/best.pt "
        f"--max_iters={n} --lr_decay_iters={n} --warmup_iters={math.ceil(0.1 * n)} --learning_rate={lr} "
        f"--eval_interval={ev} --log_interval={min(ev, 50)}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True, help="seeds per arm, from the registration's n rule")
    ap.add_argument("--pope_lr", required=True, help="PoPE's chosen pretraining lr, e.g. 1e-3")
    ap.add_argument("--rope_lr", default="1e-3", help="RoPE's chosen pretraining lr (the parent of YaRN)")
    ap.add_argument("--yarn", required=True, help="the chosen YaRN setting: STEPS,LR,RAMP")
    ap.add_argument("--yarn_code", default="", help="STEPS,LR of the secondary `code` arm (only if --yarn is paper)")
    ap.add_argument("--drope", default="", help="STEPS,LR of the chosen DroPE setting; empty: DroPE did not recover")
    ap.add_argument("--out", default="docs/runs/i60-registered.tsv")
    a = ap.parse_args()
    n, lr, ramp = a.yarn.split(",")
    if ramp not in ("code", "paper") or (a.yarn_code and ramp != "paper"):
        raise SystemExit("--yarn=STEPS,LR,RAMP with RAMP code or paper; --yarn_code only with a paper ramp")

    def pretraining(lr):  # the search's lines: min_lr a tenth of the lr, none for RoPE's default 1e-3
        return f"--learning_rate={lr} --min_lr=" + f"{float(lr) / 10:.0e}".replace("e-0", "e-")

    rope = "" if a.rope_lr == "1e-3" else " " + pretraining(a.rope_lr)
    lines = []
    for s in range(SEED0, SEED0 + a.n):
        lines.append(line("rope", s, f"--pos_encoding=rope --seed={s}{rope}"))
        lines.append(line("pope", s, f"--seed={s} {pretraining(a.pope_lr)}"))
        lines.append(line("yarn", s, yarn_args(s, int(n), lr, ramp)))
        if a.yarn_code:
            cn, clr = a.yarn_code.split(",")
            lines.append(line("yarncode", s, yarn_args(s, int(cn), clr, "code")))
        if a.drope:
            dn, dlr = a.drope.split(",")
            lines.append(line("drope", s, drope_args(s, int(dn), dlr)))
    arms = f"RoPE (lr {a.rope_lr}), PoPE (lr {a.pope_lr}), RoPE + YaRN ({n} steps, lr {lr}, ramp {ramp})"
    arms += f", YaRN code ramp ({a.yarn_code}; secondary, no test)" if a.yarn_code else ""
    arms += f", DroPE ({a.drope})" if a.drope else "; no DroPE arm (it did not recover in the search)"
    head = (
        '# issue 60, the registered comparison (docs/extrapolation.md, "The registration (issue 60)"): seeds '
        f"{SEED0} .. {SEED0 + a.n - 1},\n# one block per seed in order. Arms: {arms}.\n"
        "# Every run scored tiled at 1x-16x (the primary: ppl at 4096) and sliding at 16x. Written by\n"
        "# docs/runs/i60-registered-queue.py. Two lanes, one core each:\n"
        f"#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh {a.out} > lane-i60-0.log 2>&1 &\n"
        f"#   OMP_NUM_THREADS=1 nohup nice -n 19 bash study/lane.sh {a.out} > lane-i60-1.log 2>&1 &\n"
    )
    with open(a.out, "w") as f:
        f.write(head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
