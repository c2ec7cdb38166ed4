# RoPE baseline, human reference genome (GRCh38, Nucleotide Transformer 6-mers, vocab 4107), 16 layers x 16 heads x
# 1024.
# Paper (arXiv 2509.10534 v3): test NLL RoPE 4.217 (PoPE 4.152), Table 3; model Table 7, training Table 8.
# Data: prepare/genome.py, rows of <cls> + 1000 tokens; train chr1-20,X,Y / val chr21 / test chr22.
# Budget: ~201M non-embedding params (12 * 16 * 1024^2); 100,000 iters x 64 rows x 1000 = 6.4B tokens;
#   6 * 201M * 6.4B = 7.7e18 FLOP + attention (12 * 16 * 1000 * 1024 per token) 1.3e18 = ~9e18 FLOP
#   -> ~17 h at a sustained 150 TFLOP/s (one A100, bf16, ~50% MFU),
#   i.e. ~17 A100-hours, ~2-3 h on 8 x A100.
# The paper uses RMSNorm (model.py's norm). Same as train_genome_pope.py but for pos_encoding.
#   python prepare/genome.py --input GCF_000001405.40_GRCh38.p14_genomic.fna.gz
#   torchrun --standalone --nproc_per_node=8 train.py config/train_genome_rope.py
out_dir = 'out-genome-rope'
dataset = 'genome'
eval_interval = 2000  # assumed: not found in the paper
eval_iters = 50  # assumed: not found in the paper
log_interval = 50
wandb_log = False
wandb_project = 'pope'
wandb_run_name = 'genome-rope'

# model (Table 7, HRG column)
n_layer = 16
n_head = 16
n_embd = 1024
dropout = 0.1
bias = False  # assumed: not found in the paper
pos_encoding = 'rope'
rope_theta = 10000.0

# training (Table 8, HRG column). The paper's batch is 64 rows per step; here it is reached as a
# micro-batch of 8 x 8 accumulation steps (same effective batch): 64 rows of a 201M model do not fit
# one GPU's activations, and 8 divides over 1, 2, 4 or 8 GPUs (gradient_accumulation_steps is global).
batch_size = 8
gradient_accumulation_steps = 8
block_size = 1000  # rows are <cls> + 1000 tokens = 1001: context 1000 >= row_len - 1
learning_rate = 2.5e-4
min_lr = 2.5e-5
weight_decay = 0.01
grad_clip = 1.0
beta1 = 0.9  # assumed: not found in the paper (AdamW's default)
beta2 = 0.999
max_iters = 100000
lr_decay_iters = 100000
warmup_iters = 4000
decay_lr = True  # cosine: assumed, Table 8 gives the decay iters and min lr but not the shape
