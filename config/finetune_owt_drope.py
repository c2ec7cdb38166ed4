# DroPE, 124M, OpenWebText: the 124M RoPE model with its positional embedding dropped
# (pos_encoding 'rope' -> 'none', NoPE) and recalibrated at the original context of 1024 tokens
# (Gelberg et al. 2025, "Extending the Context of Pretrained LLMs by Dropping Their Positional
# Embeddings", arXiv 2512.12167). A baseline beside RoPE, RoPE+YaRN and PoPE: scored zero-shot at
# longer contexts with eval_extrapolate.py and eval_retrieval.py, never trained past 1024 tokens.
# Method (the paper's abstract and its public code, github.com/SakanaAI/DroPE): pretrain with RoPE,
# remove RoPE from every attention layer, keep every weight, continue training briefly at the
# pretraining context ("recalibration"), then evaluate at any length without positional embeddings.
# Settings we had to assume (the paper's text for its from-scratch runs was not available to us):
#   recalibration length: 2% of the pretraining tokens, 2000 steps x 64 x 1024 = 131M tokens of the
#     6.55B -- assumed: the upper end of the 0.5 % .. 2 % a public summary of the paper gives (the
#     public code's Llama-2-7B run: 10B tokens after 2T, 0.5 %); the same tokens as the YaRN fine-tune
#     (500 x 64 x 4096), so the two baselines cost alike;
#   learning rate 3e-4, cosine to 0, warmup 10 % of the steps, weight decay 0, AdamW betas (0.9, 0.999),
#     gradient clip 1.0 -- assumed: the public code's SmolLM-360M recalibration config and its trainer
#     defaults (the nearest model size it ships);
#   no QK-norm: the public code also ships a 'qk_norm_nope' variant; the plain 'nope' one is the
#     method as stated, and this repo's attention has no QK-norm;
#   batch 64 sequences of 1024, data and tokenizer: the pretraining run's (Table 8).
# In order (the fine-tune reads the pretraining run's best.pt; it never writes into that folder):
#   torchrun --standalone --nproc_per_node=8 train.py config/train_owt_rope.py     # pretrain with RoPE
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_owt_drope.py # this recalibration
#   python eval_extrapolate.py out-owt-124m-rope out-owt-124m-pope out-owt-124m-yarn-4096 out-owt-124m-drope
#   python eval_retrieval.py out-owt-124m-rope out-owt-124m-pope out-owt-124m-yarn-4096 out-owt-124m-drope
# train.py accepts the one change of encoding DroPE makes (rope -> none) and refuses any other (exit 2).
out_dir = 'out-owt-124m-drope'
wandb_run_name = 'owt-124m-drope'
init_from = 'finetune'
init_ckpt = 'out-owt-124m-rope/best.pt'
dataset = 'openwebtext'
eval_interval = 250  # assumed: not found in the paper
eval_iters = 200  # assumed: the pretraining value
log_interval = 10  # assumed: not found in the paper
batch_size = 8  # per GPU; the global batch is 64 sequences for 1, 2, 4 or 8 GPUs
gradient_accumulation_steps = 8  # 8 x 8 = 64 sequences per step
block_size = 1024  # the pretraining context: DroPE recalibrates at the original length
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
pos_encoding = 'none'  # RoPE dropped (the checkpoint's 'rope')
rope_theta = 10000.0  # the checkpoint's; moot without RoPE
learning_rate = 3e-4  # assumed: see above
min_lr = 0.0  # cosine to 0 (assumed: see above)
max_iters = 2000  # 2 % of the pretraining's 100,000 steps (assumed: see above)
lr_decay_iters = 2000
warmup_iters = 200  # 10 % of the steps (assumed: see above)
decay_lr = True
weight_decay = 0.0  # assumed: see above
beta1 = 0.9
beta2 = 0.999  # assumed: see above
grad_clip = 1.0
