# PoPE, genome in miniature on one CPU core: a real bacterial genome (Klebsiella pneumoniae MGH 78578,
# 5.69 Mbp, from the Debian package kleborate-examples), Nucleotide Transformer 6-mers (vocab 4107),
# 4 layers x 4 heads x 128 (the GPU config: train_genome_pope.py, 16 x 16 x 1024 on the human genome).
# Paper (arXiv 2509.10534 v3): test NLL PoPE 4.152 (RoPE 4.217) on GRCh38, Table 3; a genome 550x
# smaller and of another kingdom is not comparable to those, only its RoPE/PoPE direction is.
# Data: prepare/genome.py --source kleborate-examples: rows of <cls> + 1000 tokens; 30-kb blocks drawn
#   by hash: train 849,164 / val 60,000 / test 40,000 DNA tokens. Reference points (nats/token):
#   ln 4107 = 8.320 (uniform); the train 6-mer unigram entropy 8.083; a unigram model of train
#   scores 8.058 on test.
# Budget: 1200 x 2 rows = ~2.8 epochs of train, on one core (OMP_NUM_THREADS=1); measured CPU time per step
#   and per run: docs/cpu_scale.md, "What the CPU configs cost".
# The RoPE run shares every setting:
#   apt-get install kleborate-examples && python prepare/genome.py --source kleborate-examples
#   OMP_NUM_THREADS=1 python train.py config/train_genome_cpu.py --seed=1337 --out_dir=out-genome-cpu-pope-s1337
#   OMP_NUM_THREADS=1 python train.py config/train_genome_cpu.py --seed=1337 --pos_encoding=rope \
#       --out_dir=out-genome-cpu-rope-s1337
out_dir = 'out-genome-cpu-pope'
dataset = 'genome_klebsiella'
eval_interval = 200
eval_iters = 10  # 10 x 2 = 20 of the 60 val rows pick best.pt; metrics.json then scores every val/test row
log_interval = 10
wandb_log = False
wandb_project = 'pope'
wandb_run_name = 'genome-cpu-pope'

# model: the paper's HRG choices (Table 7) at a CPU width
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.1
bias = False
pos_encoding = 'pope'
rope_theta = 10000.0
pope_delta_init = 'uniform'  # Table 7: init range for delta 2pi -> U(-2pi, 0)
pope_magnitude = 'softplus'
pope_use_delta = True

# training: Table 8's HRG column (AdamW, beta2 0.999, wd 0.01, clip 1, lr/min_lr = 10), the peak lr
# raised from 2.5e-4 (width 1024) to 1e-3 for width 128, and 2 rows per step instead of 64: more
# steps for the same CPU time (at 4 rows x 200 steps the loss had only reached the unigram level)
batch_size = 2
gradient_accumulation_steps = 1
block_size = 1000  # rows are <cls> + 1000 tokens = 1001: context 1000 >= row_len - 1
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.01
grad_clip = 1.0
beta1 = 0.9
beta2 = 0.999
max_iters = 1200
lr_decay_iters = 1200
warmup_iters = 20
decay_lr = True
