# Indirect indexing on a CPU: the paper's diagnostic task in miniature. Both encodings solve it on some
# seeds and not others; PoPE's mean accuracy is higher, but in the pre-registered test (n = 11 per arm,
# docs/cpu_scale.md section 5) PoPE solved it no more often than RoPE (4 / 11 against 2 / 11, Fisher
# p = 0.64). The search and every earlier run: docs/indirect_indexing_cpu.md, entries 7 and 13.
# A variant of the paper's task, not the task itself: 8 letters (A-H), strings of 6-8 distinct letters,
# shifts up to ±2, 6 (source, shift, target) queries per row with the loss on every target. Each query
# is the paper's task on the row's string. The data (1M/10k/10k rows) is built on first use:
#   python prepare/indirect_indexing.py --n_letters=8 --min_len=6 --max_len=8 --max_shift=2 --n_queries=6
# PoPE (this file), on one core (OMP_NUM_THREADS=1). RoPE, the same run otherwise:
#   python train.py config/train_indirect_cpu.py --pos_encoding=rope --out_dir=out-indirect-cpu-rope
# Measured test accuracy (all query targets, best.pt): README, "The paper at CPU scale". A seed does not fix
# the outcome: the same seed on another CPU can differ.
# The paper's own setting (8 x 512, 100k steps on the GPU): config/train_indirect_{pope,rope}.py.
out_dir = 'out-indirect-cpu'
dataset = 'indirect_indexing_letters8_len6-8_shift2_q6'
eval_interval = 500
log_interval = 50
eval_iters = 20

batch_size = 64
gradient_accumulation_steps = 1
block_size = 56  # rows are 8 + 6 x 7 = 50 tokens

n_layer = 2
n_head = 4
n_embd = 64
dropout = 0.0
pos_encoding = 'pope'
pope_delta_init = 'uniform'
# rope_theta, for both encodings: with head dim 16 the default 10000 leaves most frequencies nearly still
# over a 50-token row (seed 1337 at 10000: PoPE 47 %, RoPE 29 %; docs/indirect_indexing_cpu.md, entry 7)
rope_theta = 100.0

learning_rate = 3e-3  # both encodings' pick on val from {1e-3, 3e-3, 1e-2} (notebook, entry 7)
min_lr = 3e-4
max_iters = 10000
warmup_iters = 500
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
