# Ablation: PoPE without the phase bias delta, 124M, OpenWebText. Paper (arXiv 2509.10534v3): val ppl 21.42 (full
# PoPE 21.33, RoPE 21.55), Table 5.
# Model and training: appendix B, Table 7 (model configurations) and Table 8 (training configurations).
# Budget: 64 x 1024 tokens x 100,000 iters = 6.55B tokens; 6 x 124M x 6.55B = 4.9e18 FLOP; at 40% MFU of an
# A100 (0.4 x 312 TFLOP/s bf16) ~11 A100-hours, ~1.4 h on 8xA100 (PoPE's wider q.k adds ~9%, paper A.2).
#   python prepare/openwebtext.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_owt_pope_nodelta.py
out_dir = 'out-owt-124m-pope_nodelta'
wandb_run_name = 'owt-124m-pope_nodelta'
dataset = 'openwebtext'
eval_interval = 2000  # assumed: not found in the paper (nanoGPT's value)
eval_iters = 200  # assumed: not found in the paper (nanoGPT's value)
log_interval = 10  # assumed: not found in the paper
batch_size = 8  # per GPU; the global batch is 64 sequences for 1, 2, 4 or 8 GPUs
gradient_accumulation_steps = 8  # 8 x 8 = 64 sequences per step (Table 8)
block_size = 1024
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False  # assumed: not found in the paper (nanoGPT's value)
pos_encoding = 'pope'
rope_theta = 10000.0
pope_delta_init = 'zero'  # Table 7: init range for delta 0
pope_magnitude = 'softplus'
pope_use_delta = False
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 100000
lr_decay_iters = 100000
warmup_iters = 1000
decay_lr = True  # cosine: assumed, Table 8 gives the decay iters and min lr but not the shape
weight_decay = 0.01
beta1 = 0.9  # assumed: not found in the paper (AdamW's default)
beta2 = 0.95
grad_clip = 1.0
