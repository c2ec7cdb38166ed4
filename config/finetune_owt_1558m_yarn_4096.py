# RoPE + YaRN (s = 4), 1.5B, OpenWebText: the 1.5B RoPE model fine-tuned at 4096 tokens with
# YaRN frequencies (Peng et al. 2024; model.rope_frequencies), original context 1024.
# Paper: the length-extrapolation experiment (PG-19 test books at 1024 .. 10240 tokens; lines RoPE,
# RoPE+YaRN, PoPE, PoPE+ft). Recipe: sequences of 4096, 500 steps, warmup 20, batch 64, lr 6e-5 with no decay.
# Budget: 500 x 64 x 4096 = 131M tokens; 1.7e18 FLOP (6N + attention at 4096, model.flops_per_token), ~3.8
# A100-hours at 40% MFU, ~29 min on 8xA100 -- about 3% of the pretraining run (~136 A100-hours).
# In order (the fine-tune reads the pretraining run's best.pt; it never writes into that folder):
#   python prepare/openwebtext.py && python prepare/pg19.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_owt_1558m_rope.py     # pretrain at 1024
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_owt_1558m_yarn_4096.py   # this fine-tune
#   (and config/train_owt_1558m_pope.py, config/finetune_owt_1558m_pope_4096.py for the other two lines)
#   python eval_extrapolate.py out-owt-1558m-rope out-owt-1558m-pope out-owt-1558m-yarn-4096 out-owt-1558m-pope-4096
# An interrupted fine-tune continues with --init_from=resume (from its own out_dir/ckpt.pt).
# The architecture below must equal the checkpoint's: train.py refuses (exit 2) another encoding or shape.
out_dir = 'out-owt-1558m-yarn-4096'
wandb_run_name = 'owt-1558m-yarn-4096'
init_from = 'finetune'
init_ckpt = 'out-owt-1558m-rope/best.pt'
dataset = 'openwebtext'
eval_interval = 100  # assumed: not found in the paper
eval_iters = 50  # assumed: not found in the paper (50 x 64 x 4096 = 13M val tokens per evaluation)
log_interval = 10  # assumed: not found in the paper
batch_size = 1  # per GPU; the global batch is 64 sequences for 1, 2, 4 or 8 GPUs
gradient_accumulation_steps = 64  # 1 x 64 = 64 sequences per step
block_size = 4096
n_layer = 48
n_head = 25
n_embd = 1600
dropout = 0.0
bias = False
pos_encoding = 'rope'
rope_theta = 10000.0
rope_scaling = 4.0  # YaRN s = L'/L = 4096 / 1024
rope_original_block_size = 1024  # L: the pretraining context
learning_rate = 6e-5
min_lr = 6e-5  # = learning_rate: constant after the warmup ("no decay")
max_iters = 500
lr_decay_iters = 500
warmup_iters = 20
decay_lr = True  # linear warmup over 20 steps; the cosine from 6e-5 to 6e-5 is flat
weight_decay = 0.01  # assumed: the pretraining value
beta1 = 0.9  # assumed: the pretraining value
beta2 = 0.95  # assumed: the pretraining value
grad_clip = 1.0  # assumed: the pretraining value
# past one GPU's memory, as the pretraining run (sharding.py); at 4096 tokens activation checkpointing keeps one
# Block's activations at a time
fsdp = True
activation_checkpointing = True
