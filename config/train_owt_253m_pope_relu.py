# Ablation: PoPE with ReLU instead of softplus, 253M, OpenWebText. Paper (arXiv 2509.10534v3): val ppl 18.9 (full
# PoPE 18.55, RoPE 18.88), Table 5.
# Model and training: appendix B, Table 7 (model configurations) and Table 8 (training configurations).
# Budget: 64 x 1024 tokens x 100,000 iters = 6.55B tokens; 6 x 253M x 6.55B = 9.9e18 FLOP; at 40% MFU of an
# A100 (0.4 x 312 TFLOP/s bf16) ~22 A100-hours, ~2.8 h on 8xA100 (PoPE's wider q.k adds ~7%, paper A.2).
#   python prepare/openwebtext.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_owt_253m_pope_relu.py
out_dir = 'out-owt-253m-pope_relu'
wandb_run_name = 'owt-253m-pope_relu'
dataset = 'openwebtext'
eval_interval = 2000  # assumed: not found in the paper (nanoGPT's value)
eval_iters = 200  # assumed: not found in the paper (nanoGPT's value)
log_interval = 10  # assumed: not found in the paper
batch_size = 8  # per GPU; the global batch is 64 sequences for 1, 2, 4 or 8 GPUs
gradient_accumulation_steps = 8  # 8 x 8 = 64 sequences per step (Table 8)
block_size = 1024
n_layer = 16
n_head = 16
n_embd = 1024
dropout = 0.0
bias = False  # assumed: not found in the paper (nanoGPT's value)
pos_encoding = 'pope'
rope_theta = 10000.0
pope_delta_init = 'zero'  # Table 7: init range for delta 0
pope_magnitude = 'relu'
pope_use_delta = True
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
