# DroPE at CPU scale: the quick start's RoPE run (python train.py --pos_encoding=rope
# --out_dir=out-shakespeare-char-rope: character-level Shakespeare, 4 x 128, context 256, 3000 steps of
# 8 x 256 characters) with its positional embedding dropped (pos_encoding 'rope' -> 'none') and
# recalibrated at the original context of 256 characters (Gelberg et al. 2025, arXiv 2512.12167).
# The settings scale the OWT DroPE configs (config/finetune_owt_drope.py, which lists what is assumed):
#   recalibration length: 2 % of the pretraining's 3000 steps = 60 steps of 8 x 256 characters (assumed);
#   learning rate 3e-4 (assumed: the public code's SmolLM-360M value; the pretraining peak here is 1e-3),
#   cosine to 0, warmup 10 % of the steps, weight decay 0, AdamW betas (0.9, 0.999), clip 1.0 (assumed).
# Evaluate with the two runs it sits beside:
#   python train.py config/finetune_shakespeare_char_drope.py
#   python eval_retrieval.py out-shakespeare-char-rope out-shakespeare-char-pope out-shakespeare-char-drope
#   python eval_extrapolate.py out-shakespeare-char-rope out-shakespeare-char-pope out-shakespeare-char-drope \
#       --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 --max_tokens=65536
out_dir = 'out-shakespeare-char-drope'
init_from = 'finetune'
init_ckpt = 'out-shakespeare-char-rope/best.pt'
dataset = 'shakespeare_char'
pos_encoding = 'none'  # RoPE dropped (the checkpoint's 'rope')
block_size = 256  # the pretraining context
eval_interval = 20
eval_iters = 20
log_interval = 10
learning_rate = 3e-4
min_lr = 0.0
max_iters = 60
lr_decay_iters = 60
warmup_iters = 6
weight_decay = 0.0
beta2 = 0.999
