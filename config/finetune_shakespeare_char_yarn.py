# RoPE + YaRN (s = 4) at CPU scale: the quick start's RoPE run (python train.py --pos_encoding=rope
# --out_dir=out-shakespeare-char-rope: character-level Shakespeare, 4 x 128, context 256, 3000 steps of
# 8 x 256 characters, lr 1e-3) fine-tuned at 4x its context, 1024 characters, with YaRN frequencies
# (Peng et al. 2024; model.rope_frequencies), original context 256 (issue 54).
# The recipe scales config/finetune_owt_yarn_4096.py (the paper's: 500 steps of 64 x 4096 tokens, warmup 20,
# lr 6e-5 constant, after 100,000 steps of 64 x 1024 at a peak lr of 6e-4):
#   fine-tuning tokens: 2 % of the pretraining's (OWT: 131M of 6.55B). Here 2 % of 3000 x 8 x 256 = 122,880
#     characters = 15 steps of 8 x 1024 (the pretraining's 8 sequences per step, as the OWT fine-tune keeps 64);
#   warmup: 20 / 500 = 4 % of the steps = 0.6 here, rounded up to 1 step (assumed);
#   lr: a tenth of the pretraining peak (OWT 6e-5 = 6e-4 / 10), constant: 1e-4 here (assumed: the ratio carries
#     over to a 0.8M model with another pretraining lr);
#   weight decay, betas, clip: the pretraining's (assumed, as the OWT fine-tune assumes its pretraining's).
# The YaRN paper's own Llama 2 recipe is smaller still (s = 16: 400 steps, 0.1 % of pretraining, lr 2e-5).
# In order (the fine-tune reads the RoPE run's best.pt; it never writes into that folder):
#   python train.py --pos_encoding=rope --out_dir=out-shakespeare-char-rope
#   python train.py config/finetune_shakespeare_char_yarn.py
#   python eval_extrapolate.py out-shakespeare-char-rope out-shakespeare-char-pope out-shakespeare-char-yarn \
#       --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 --max_tokens=65536
# eval_extrapolate.py reads rope_scaling and rope_original_block_size from the checkpoint (label rope+yarn(s=4,code)).
# The architecture must equal the checkpoint's: train.py refuses (exit 2) another encoding or shape.
out_dir = 'out-shakespeare-char-yarn'
init_from = 'finetune'
init_ckpt = 'out-shakespeare-char-rope/best.pt'
dataset = 'shakespeare_char'
pos_encoding = 'rope'
rope_theta = 10000.0
rope_scaling = 4.0  # YaRN s = L'/L = 1024 / 256
rope_original_block_size = 256  # L: the pretraining context
rope_yarn_ramp = 'code'  # the released YaRN code's ramp (Hugging Face's); issue 54's runs (d729a25) had 'paper'
block_size = 1024
batch_size = 8  # the pretraining's sequences per step
gradient_accumulation_steps = 1
max_iters = 15  # 15 x 8 x 1024 = 122,880 characters = 2 % of the pretraining's 6,144,000
lr_decay_iters = 15
warmup_iters = 1  # assumed: 4 % of 15 steps, rounded up
learning_rate = 1e-4  # assumed: a tenth of the pretraining peak (1e-3), as 6e-5 is of 6e-4 in the OWT recipe
min_lr = 1e-4  # = learning_rate: constant after the warmup ("no decay")
decay_lr = True  # linear warmup over 1 step; the cosine from 1e-4 to 1e-4 is flat
eval_interval = 5  # assumed: evaluations at steps 0, 5, 10, 15
eval_iters = 20  # assumed: the pretraining's (20 x 8 x 1024 validation characters per evaluation)
log_interval = 5  # assumed
weight_decay = 0.01  # assumed: the pretraining value
beta1 = 0.9  # assumed: the pretraining value
beta2 = 0.99  # assumed: the pretraining value
grad_clip = 1.0  # assumed: the pretraining value
