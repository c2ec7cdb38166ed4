"""Run several train.py jobs in one torchrun launch (tests/test_fsdp.py): each process joins one real gloo process
group, then calls train.main for each job in turn, keeping the group between jobs (train.py would create and
destroy one per run; starting torchrun costs seconds on a loaded CPU, so the cases share one launch).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_jobs.py JOBS.json

JOBS.json: a list of {"argv": [train.py arguments]} or {"copy": [src, dst]} (rank 0 copies a run folder while
the others wait)."""

import gc
import json
import os
import shutil
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402

dist.init_process_group("gloo")
destroy = dist.destroy_process_group
dist.init_process_group = lambda *args, **kwargs: None  # the launch's group serves every job
dist.destroy_process_group = lambda *args, **kwargs: None
with open(sys.argv[1]) as f:
    jobs = json.load(f)
for job in jobs:
    if "copy" in job:
        if dist.get_rank() == 0:
            shutil.copytree(*job["copy"])
    else:
        train.main(job["argv"])
    gc.collect()
    dist.barrier()
destroy()
