# Indirect indexing on a CPU: the paper's diagnostic task at laptop scale (what `python train.py`
# ran before it became the Shakespeare length-extrapolation run). PoPE, 4 x 128, 4000 steps of
# 64 rows: about 11 minutes on 2 quiet CPU cores. The RoPE counterpart:
#   python train.py config/train_indirect_cpu.py --pos_encoding=rope --out_dir=out-indirect-cpu-rope
# Expect both near chance (1/52 = 1.9 %, loss ln 52 = 3.95 nats): the task needs about 100k GPU steps
# of an 8 x 512 model before either encoding leaves chance (config/train_indirect_{pope,rope}.py).
# The dataset (1M/10k/10k examples) is built on first use: python prepare/indirect_indexing.py
out_dir = 'out-indirect-cpu'
dataset = 'indirect_indexing'
eval_interval = 500
log_interval = 50
eval_iters = 20

batch_size = 64
gradient_accumulation_steps = 1
block_size = 64  # rows are <= 48 tokens

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_encoding = 'pope'
pope_delta_init = 'uniform'

learning_rate = 2e-3
min_lr = 2e-4
max_iters = 4000
warmup_iters = 200
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
