# PoPE, 1.5B (GPT-2 XL's shape: 48 layers, 1600 wide, 25 heads of 64), OpenWebText: past the paper, whose largest
# model is 774M (arXiv 2509.10534v3, Table 4). Its recipe as the 774M run has it (Table 8: global batch 64 x 1024,
# 100k steps, lr 6e-4 to 6e-5, warmup 1000, beta2 0.95, clip 1.0); only the shape grows.
# Budget: 64 x 1024 tokens x 100,000 iters = 6.55B tokens; 6 x 1555M x 6.55B = 6.1e19 FLOP; at 40% MFU of an A100
# ~136 A100-hours, ~17 h on 8xA100, plus the recomputed forward of activation checkpointing (+1/3: ~23 h).
# Memory per GPU at 8 ranks (train.py prints it at start; bench.py --only=shard): fp32 weights, gradients and AdamW
# state 25 GB per rank unsharded (DDP), 3.1 GB under FSDP, whose gradients are reduce-scattered after each of a rank's
# 2 micro-steps (fsdp_reduce_every_micro_step=True, the default: 98 reduce-scatters per step; reduced on the last only,
# 49, each rank would hold whole fp32 gradients meanwhile: 8.6 GB); activations of a micro-batch of 4 x 1024 in bf16
# ~1.9 GiB with activation checkpointing (~11 GiB without; the logits are 1.2 GB of either).
#   python prepare/openwebtext.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_owt_1558m_pope.py
#   (several nodes: docs/usage.md, "More than one GPU")
out_dir = 'out-owt-1558m-pope'
wandb_run_name = 'owt-1558m-pope'
dataset = 'openwebtext'
eval_interval = 2000  # assumed: not found in the paper (nanoGPT's value)
eval_iters = 200  # assumed: not found in the paper (nanoGPT's value)
log_interval = 10  # assumed: not found in the paper
batch_size = 4  # per GPU; the global batch is 64 sequences for 1, 2, 4 or 8 GPUs
gradient_accumulation_steps = 16  # 4 x 16 = 64 sequences per step (Table 8)
block_size = 1024
n_layer = 48
n_head = 25
n_embd = 1600
dropout = 0.0
bias = False  # assumed: not found in the paper (nanoGPT's value)
pos_encoding = 'pope'
rope_theta = 10000.0
pope_delta_init = 'zero'  # Table 7: init range for delta 0
pope_magnitude = 'softplus'
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
# past one GPU's memory (sharding.py): parameters, gradients and AdamW state sharded over the ranks, each Block
# recomputed in the backward, bf16 compute with fp32 reduce and master weights (MixedPrecisionPolicy)
fsdp = True
fsdp_reduce_every_micro_step = True  # sharded gradients through the micro-steps (see above)
activation_checkpointing = True
checkpoint_format = 'single'  # ckpt.pt, best.pt gathered to rank 0 (12 GB of CPU memory there); 'dcp': sharded
