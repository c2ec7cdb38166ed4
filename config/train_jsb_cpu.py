# PoPE, JSB Chorales in miniature on one CPU core: music21's Bach chorales (NOT the official split),
# 16th-note grid, raster-scan order, 4 layers x 4 heads x 128 (the GPU config: train_jsb_pope.py, 6 x 8 x 256).
# Paper (arXiv 2509.10534 v3): test NLL PoPE 0.4889 (RoPE 0.5081), Table 2, on the official split; the
# numbers of this config are not comparable to those, only its RoPE/PoPE direction is.
# Data: prepare/jsb.py --source music21 (offline): 368 four-part chorales shuffled (seed 1337) into
#   221/73/74 pieces, rows of 2048 tokens (median 768 real), vocab 90; ~194k train tokens.
# Budget: one core (OMP_NUM_THREADS=1); measured CPU time per step and per run: docs/cpu_scale.md,
#   "What the CPU configs cost".
#   600 x 4 rows = ~11 epochs of the 222 train rows: hence the paper's dropout 0.2, and best.pt by val.
# The RoPE run shares every setting:
#   python prepare/jsb.py --source music21
#   OMP_NUM_THREADS=1 python train.py config/train_jsb_cpu.py --seed=1337 --out_dir=out-jsb-cpu-pope-s1337
#   OMP_NUM_THREADS=1 python train.py config/train_jsb_cpu.py --seed=1337 --pos_encoding=rope \
#       --out_dir=out-jsb-cpu-rope-s1337
out_dir = 'out-jsb-cpu-pope'
dataset = 'jsb_music21'
eval_interval = 100
eval_iters = 8  # 8 x 4 = 32 of the 74 val rows pick best.pt; metrics.json then scores every val/test row
log_interval = 10
wandb_log = False
wandb_project = 'pope'
wandb_run_name = 'jsb-cpu-pope'

# model: the paper's JSB choices (Table 7) at a CPU width
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.2
bias = False
pos_encoding = 'pope'
rope_theta = 10000.0
pope_delta_init = 'uniform'  # Table 7: init range for delta 2pi -> U(-2pi, 0)
pope_magnitude = 'softplus'
pope_use_delta = True

# training: Table 8's JSB column (batch 4, AdamW, beta2 0.99, wd 0.01, clip 1, lr/min_lr = 10),
# the peak lr raised from 6e-4 (width 256) to 1e-3 for width 128, the default CPU run's rate at this size
batch_size = 4
gradient_accumulation_steps = 1
block_size = 2048  # rows are 2048 tokens: context 2047 >= row_len - 1
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.01
grad_clip = 1.0
beta1 = 0.9
beta2 = 0.99
max_iters = 600
lr_decay_iters = 600
warmup_iters = 20
decay_lr = True
