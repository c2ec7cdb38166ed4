# PoPE+ft at 32k tokens with context parallelism: the 124M PoPE model (pretrained at 1024) fine-tuned at 32,768
# tokens, no interpolation (PoPE's frequencies are unchanged), each sequence split over 4 GPUs.
# 8 GPUs = dp 2 x cp 4 (context_parallel.py): a cp group of 4 ranks reads the same rows and each rank keeps 8,192
# tokens of each (chunks i and 7 - i of 8, head-tail); FSDP2 shards the weights over all 8; activation
# checkpointing recomputes each Block (and its all-gather of k and v) in the backward.
# Recipe: the 4096 fine-tune's (config/finetune_owt_pope_4096.py) at the same tokens per step: 8 sequences of
# 32,768 = 262k tokens, 500 steps, warmup 20, lr 6e-5 with no decay (assumed: the paper fine-tunes at 4096 only).
#   torchrun --standalone --nproc_per_node=8 train.py config/train_owt_pope.py          # the 1024 parent
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_owt_pope_32k_cp.py
# Per rank (bf16, printed by train.py at start; context_parallel.memory_report): 8,192 tokens per row; one layer's
# gathered keys and values 96 MiB (k and v: 32,768 x 12 heads x 64 x 2 bytes each); the communication per layer
# and step: docs/usage.md, "Context parallelism". Checked on CPU with these dimensions at a small T by
# tests/test_context_parallel.py (test_the_32k_cp_config_runs_with_its_real_dimensions_on_2_ranks).
out_dir = 'out-owt-124m-pope-32k-cp'
wandb_run_name = 'owt-124m-pope-32k-cp'
init_from = 'finetune'
init_ckpt = 'out-owt-124m-pope/best.pt'
dataset = 'openwebtext'
eval_interval = 100  # assumed
eval_iters = 20  # assumed (20 x 8 x 32k = 5M val tokens per evaluation)
log_interval = 10  # assumed
batch_size = 1  # rows per dp group and micro-step (the cp group shares them)
gradient_accumulation_steps = 8  # global micro-batches per step: 8 rows of 32k; 4 micro-steps per rank at dp 2
block_size = 32768
context_parallel_degree = 4  # block_size divisible by 2 x 4; 8 GPUs -> dp 2
fsdp = True
activation_checkpointing = True
compile = False  # context parallelism runs eagerly (train.py refuses compile=True with cp > 1)
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
pos_encoding = 'pope'
rope_theta = 10000.0
pope_magnitude = 'softplus'
pope_use_delta = True
learning_rate = 6e-5
min_lr = 6e-5  # = learning_rate: constant after the warmup ("no decay")
max_iters = 500
lr_decay_iters = 500
warmup_iters = 20
decay_lr = True
weight_decay = 0.01  # assumed: the pretraining value
beta1 = 0.9  # assumed: the pretraining value
beta2 = 0.95  # assumed: the pretraining value
grad_clip = 1.0  # assumed: the pretraining value
