"""Issue 60's speed probe (docs/extrapolation.md, "The search (issue 60)"): CPU seconds per optimizer step (median of
5 after one warm-up step) and per eval forward batch, for the shapes the search trains: RoPE / PoPE pretraining
(8 x 256), YaRN (8 x 1024), DroPE (8 x 256); train.py's default model (4 x 4 heads x 128). From the repo root:

    OMP_NUM_THREADS=1 python docs/runs/i60-speed-probe.py
"""

import sys
import time

import torch

sys.path.insert(0, ".")
from model import GPT, GPTConfig

torch.manual_seed(0)


def probe(T, B=8, steps=6, **kw):
    m = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=T, vocab_size=128, attn_backend='torch', **kw))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x = torch.randint(0, 84, (B, T))
    y = torch.randint(0, 84, (B, T))
    ts = []
    for _ in range(steps):
        t = time.process_time()
        _, loss = m(x, y)[:2]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ts.append(time.process_time() - t)
    ev = time.process_time()
    with torch.no_grad():
        for _ in range(3):
            m(x, y)
    ev = (time.process_time() - ev) / 3
    return sorted(ts[1:])[len(ts[1:]) // 2], ev


for name, T, kw in [
    ('rope 8x256 (pretraining)', 256, dict(pos_encoding='rope')),
    ('pope 8x256 (pretraining)', 256, dict(pos_encoding='pope')),
    ('yarn 8x1024', 1024, dict(pos_encoding='rope', rope_scaling=4.0, rope_original_block_size=256)),
    ('drope 8x256', 256, dict(pos_encoding='none')),
]:
    s, e = probe(T, **kw)
    print(f'{name}: {s:.3f} CPU s/step (median of 5), eval forward {e:.3f} CPU s/batch')
