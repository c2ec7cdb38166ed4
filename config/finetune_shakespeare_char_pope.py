# PoPE+ft at CPU scale: the quick start's PoPE run (python train.py: character-level Shakespeare, 4 x 128,
# context 256, 3000 steps of 8 x 256 characters, lr 1e-3) fine-tuned at 4x its context, 1024 characters, with
# its frequencies unchanged (PoPE needs no interpolation). The paper's PoPE+ft arm beside YaRN's
# (config/finetune_shakespeare_char_yarn.py): the same recipe, the same characters; only the encoding differs.
# As in the YaRN config: 2 % of the pretraining's characters (15 steps of 8 x 1024), warmup 4 % of the steps
# rounded up, a constant lr a tenth of the pretraining peak (all assumed; the paper's OWT recipe scaled down).
# Issue 74 sets max_iters, warmup_iters and the lr for both fine-tunes on validation (docs/extrapolation.md).
# In order (the fine-tune reads the PoPE run's best.pt; it never writes into that folder):
#   python train.py --out_dir=out-shakespeare-char-pope
#   python train.py config/finetune_shakespeare_char_pope.py
#   python eval_extrapolate.py out-shakespeare-char-pope out-shakespeare-char-pope-ft \
#       --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 --max_tokens=65536
# The architecture must equal the checkpoint's: train.py refuses (exit 2) another encoding or shape.
out_dir = 'out-shakespeare-char-pope-ft'
init_from = 'finetune'
init_ckpt = 'out-shakespeare-char-pope/best.pt'
dataset = 'shakespeare_char'
pos_encoding = 'pope'
rope_theta = 10000.0
block_size = 1024  # 4x the pretraining context
batch_size = 8  # the pretraining's sequences per step
gradient_accumulation_steps = 1
max_iters = 15  # 15 x 8 x 1024 = 122,880 characters = 2 % of the pretraining's 6,144,000
lr_decay_iters = 15
warmup_iters = 1  # assumed: 4 % of 15 steps, rounded up
learning_rate = 1e-4  # assumed: a tenth of the pretraining peak (1e-3)
min_lr = 1e-4  # = learning_rate: constant after the warmup ("no decay")
decay_lr = True  # linear warmup over 1 step; the cosine from 1e-4 to 1e-4 is flat
eval_interval = 5  # assumed: evaluations at steps 0, 5, 10, 15
eval_iters = 20  # assumed: the pretraining's (20 x 8 x 1024 validation characters per evaluation)
log_interval = 5  # assumed
weight_decay = 0.01  # assumed: the pretraining value
beta1 = 0.9  # assumed: the pretraining value
beta2 = 0.99  # assumed: the pretraining value
grad_clip = 1.0  # assumed: the pretraining value
