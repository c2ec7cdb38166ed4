# RoPE baseline, MAESTRO v3.0.0 piano MIDI as REMI tokens (vocab 328), 6 layers x 8 heads x 384.
# Paper (arXiv 2509.10534 v3): test NLL RoPE 1.501 (PoPE 1.486), Table 2; model Table 7, training Table 8.
# Data: prepare/maestro.py, rows of 2048 tokens, 90/5/5 split by file, train transposed by -3..+3.
# Budget: ~10.6M non-embedding params (12 * 6 * 384^2); 60,000 iters x 16 rows x 2048 = 1.97B token slots;
#   6 * 10.6M * 1.97B = 1.25e17 FLOP + attention (12 * 6 * 2048 * 384 per token) 1.1e17 = ~2.4e17 FLOP
#   -> ~1 h at a sustained 80 TFLOP/s (one A100, bf16); a small model
#   like this is memory-bound, so plan for more.
# The paper uses RMSNorm (model.py's norm). Same as train_maestro_pope.py but for pos_encoding.
#   python prepare/maestro.py --input maestro-v3.0.0/
#   python train.py config/train_maestro_rope.py
out_dir = 'out-maestro-rope'
dataset = 'maestro'
eval_interval = 1000  # assumed: not found in the paper
eval_iters = 50  # assumed: not found in the paper
log_interval = 50
wandb_log = False
wandb_project = 'pope'
wandb_run_name = 'maestro-rope'

# model (Table 7, MAESTRO column)
n_layer = 6
n_head = 8
n_embd = 384
dropout = 0.1
bias = False  # assumed: not found in the paper
pos_encoding = 'rope'
rope_theta = 10000.0

# training (Table 8, MAESTRO column). The paper's batch is 16 rows per step; here it is reached as a
# micro-batch of 4 x 4 accumulation steps (same effective batch), so it fits 24 GB cards and divides
# over 1, 2 or 4 GPUs (gradient_accumulation_steps is global, split across ranks).
batch_size = 4
gradient_accumulation_steps = 4
block_size = 2048  # rows are 2048 tokens: context 2047 >= row_len - 1
learning_rate = 6e-4
min_lr = 6e-5
weight_decay = 0.01
grad_clip = 1.0
beta1 = 0.9  # assumed: not found in the paper (AdamW's default)
beta2 = 0.99
max_iters = 60000
lr_decay_iters = 60000
warmup_iters = 500
decay_lr = True  # cosine: assumed, Table 8 gives the decay iters and min lr but not the shape
