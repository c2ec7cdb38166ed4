# Indirect indexing, alibi_half: a baseline of the paper's appendix (Table "additional baselines",
# indirect indexing): ALiBi on 4 of the 8 heads (the standard slopes for 4 heads, 2^-2 .. 2^-8),
# no positional signal on the other 4.
# Paper: test accuracy 27.35 % (RoPE 11.16 +- 2.45 %, PoPE 94.82 +- 2.91 %).
# Everything but pos_encoding as in config/train_indirect_rope.py.
# Budget: 100k steps of 64 x <=47 tokens with a 25M-parameter model, ~0.45 TFLOP per step (6 N tokens):
# 4.5e16 FLOP in all, but at this size a step is launch-bound: roughly 1 GPU-hour on one A100 with compile.
# The dataset (1M/10k/10k examples) is built on first use: python prepare/indirect_indexing.py
out_dir = 'out-indirect-alibi_half'
dataset = 'indirect_indexing'
eval_interval = 2000
log_interval = 100
eval_iters = 40

batch_size = 64
gradient_accumulation_steps = 1
block_size = 64  # rows are <= 48 tokens

n_layer = 8
n_head = 8
n_embd = 512
dropout = 0.0
pos_encoding = 'alibi_half'
pope_delta_init = 'uniform'  # unused by this encoding; as train_indirect_rope.py sets it

learning_rate = 2e-4
min_lr = 2e-5
max_iters = 100000
lr_decay_iters = 100000
warmup_iters = 4000
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
