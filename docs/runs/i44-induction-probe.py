"""Issue 44's induction probe (a notebook record, not a tool): does a small GPT learn to copy, on nothing
but repeated random tokens, within a CPU budget? Each sequence is random spans of m tokens (uniform in
mmin .. mmax, ids uniform over V) each followed by itself; it prints the training loss on the first copies
(nothing to predict: ln V) and on the second copies (0 nats for a model that copies) every 100 steps.
AdamW, linear warmup 100 steps then a constant lr, clip 1.0. From the repo root:

    OMP_NUM_THREADS=1 python docs/runs/i44-induction-probe.py --pe rope --T 64 --B 64 --lr 3e-3 --mmin 4 --mmax 24

Runs and logs: docs/extrapolation.md, "The CPU-scale search"; docs/runs/i44-probe-*.txt.
"""

import sys
import time

import torch

sys.path.insert(
    0,
    __import__("os").path.dirname(
        __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    ),
)
import argparse

from model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--pe", default="rope")
p.add_argument("--L", type=int, default=2)
p.add_argument("--E", type=int, default=128)
p.add_argument("--H", type=int, default=4)
p.add_argument("--V", type=int, default=84)
p.add_argument("--B", type=int, default=16)
p.add_argument("--T", type=int, default=256)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--mmin", type=int, default=8)
p.add_argument("--mmax", type=int, default=64)
p.add_argument("--wd", type=float, default=0.01)
a = p.parse_args()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)


def batch(B, T):
    xs, ms = [], []
    for _ in range(B):
        seq, mask = [], []
        while len(seq) < T + 1:
            m = int(torch.randint(a.mmin, a.mmax + 1, (1,), generator=g))
            s = torch.randint(0, a.V, (m,), generator=g).tolist()
            seq += s + s
            mask += [0] * m + [1] * m
        xs.append(seq[: T + 1])
        ms.append(mask[: T + 1])
    x = torch.tensor(xs)
    m = torch.tensor(ms)
    return x[:, :-1], x[:, 1:], m[:, 1:]


cfg = GPTConfig(
    block_size=a.T,
    vocab_size=a.V,
    n_layer=a.L,
    n_head=a.H,
    n_embd=a.E,
    pos_encoding=a.pe,
    pope_delta_init="zero",
    attn_backend="torch",
)
model = GPT(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd, betas=(0.9, 0.99))
t0 = time.time()
for it in range(a.steps + 1):
    x, y, m = batch(a.B, a.T)
    logits, _ = model(x, y)
    lp = torch.nn.functional.cross_entropy(logits.reshape(-1, a.V), y.reshape(-1), reduction="none").view_as(y)
    loss = lp.mean()
    if it % 100 == 0:
        with torch.no_grad():
            l2 = (lp * m).sum() / m.sum()
            l1 = (lp * (1 - m)).sum() / (1 - m).sum()
        print(
            f"{it} loss {loss.item():.3f} first {l1.item():.3f} second {l2.item():.3f} {time.time() - t0:.0f}s",
            flush=True,
        )
    lr = a.lr * min(1, (it + 1) / 100)
    for pg in opt.param_groups:
        pg["lr"] = lr
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
