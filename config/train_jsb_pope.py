# PoPE, JSB Chorales (Bach, 16th-note grid, raster-scan order), 6 layers x 8 heads x 256.
# Paper (arXiv 2509.10534 v3): test NLL PoPE 0.4889 (RoPE 0.5081), Table 2; model Table 7, training Table 8.
# Data: prepare/jsb.py, rows of 2048 tokens (512 16th-note steps x 4 voices), vocab 90.
# Budget: ~4.7M non-embedding params (12 * 6 * 256^2); 3000 iters x 4 rows x 2048 = 24.6M token slots;
#   ~6 * 4.7M * 24.6M = 0.7 PFLOP + attention (12 * 6 * 2048 * 256 per token) ~0.9 PFLOP -> ~1.6 PFLOP,
#   seconds of pure compute; overhead-bound in practice.
# The paper uses RMSNorm (model.py's norm).
#   python prepare/jsb.py --input Jsb16thSeparated.json   (or no --input: downloads it)
#   python train.py config/train_jsb_pope.py
out_dir = 'out-jsb-pope'
dataset = 'jsb'
eval_interval = 100  # assumed: not found in the paper
eval_iters = 20  # assumed: not found in the paper (20 x 4 rows covers the 79 val rows)
log_interval = 10
wandb_log = False
wandb_project = 'pope'
wandb_run_name = 'jsb-pope'

# model (Table 7, JSB column)
n_layer = 6
n_head = 8
n_embd = 256
dropout = 0.2
bias = False  # assumed: not found in the paper
pos_encoding = 'pope'
rope_theta = 10000.0
pope_delta_init = 'uniform'  # Table 7: init range for delta 2pi -> U(-2pi, 0)
pope_magnitude = 'softplus'
pope_use_delta = True

# training (Table 8, JSB column)
batch_size = 4
gradient_accumulation_steps = 1
block_size = 2048  # rows are 2048 tokens: context 2047 >= row_len - 1
learning_rate = 6e-4
min_lr = 6e-5
weight_decay = 0.01
grad_clip = 1.0
beta1 = 0.9  # assumed: not found in the paper (AdamW's default)
beta2 = 0.99
max_iters = 3000
lr_decay_iters = 3000
warmup_iters = 10
decay_lr = True  # cosine: assumed, Table 8 gives the decay iters and min lr but not the shape
