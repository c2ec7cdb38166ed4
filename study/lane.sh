#!/usr/bin/env bash
# One lane of an experiment queue: runs the QUEUE files' lines one after another, resumably. Start
# one lane per core; each takes the next line that no other lane holds (a lock on OUT_DIR/lane.lock,
# released when its process ends, so a killed lane's run is taken up again by the next lane started):
#   nohup bash study/lane.sh docs/runs/QUEUE.tsv > lane0.log 2>&1 &
#   nohup bash study/lane.sh docs/runs/QUEUE.tsv > lane1.log 2>&1 &
# A QUEUE line: NAME <tab> OUT_DIR <tab> train.py arguments [<tab> a command run after training]; one tab
# between fields, an empty field stays empty (NAME<tab>OUT_DIR<tab><tab>CMD: no train.py arguments).
# Lines starting with # are comments; a queue file's last line needs no newline.
# A run whose record docs/runs/NAME.json is there is done, also in a fresh checkout without out/ (a study
# that spans sessions), where its line has no after-command or the record says it ran ("after_done": true
# in its "run" entry; records from before that: NAME.extrapolation.csv is there); delete the record to run
# it again. A run whose OUT_DIR/metrics.json exists is not trained again; one with
# OUT_DIR/ckpt.pt resumes (--init_from=resume). A line whose arguments hold --init_ckpt=RUN/best.pt (a DroPE
# or YaRN fine-tune) waits while another lane trains RUN and is skipped while RUN has no metrics.json, so it
# never starts from an unfinished run. The after-command runs once (marker OUT_DIR/after.done). Each run gets one
# core (OMP_NUM_THREADS=1) at low priority, or LANE_THREADS of them (LANE_THREADS=2 bash study/lane.sh ...: one lane
# whose runs take both cores, for a run that must end within one session when the next may be on another
# machine; the record's provenance.device.threads says which); /usr/bin/time -v writes its wall and CPU time to
# OUT_DIR/time.txt. Results are copied to docs/runs/NAME.json (metrics.json plus wall and CPU time),
# the training log to docs/runs/NAME.log.jsonl (the curve) and, if the after-command wrote
# OUT_DIR/extrapolate/extrapolation.csv, docs/runs/NAME.extrapolation.csv; OUT_DIR/retrieval/passkey.csv and
# copy.csv (eval_retrieval.py), docs/runs/NAME.passkey.csv and NAME.copy.csv.
set -u
{  # the whole script is read before it runs, so editing lane.sh (a git pull) cannot break a running lane
(( $# >= 1 )) || { echo "usage: lane.sh QUEUE.tsv [QUEUE.tsv ...]" >&2; exit 2; }
cd "$(dirname "$0")/.."  # the repo root: train.py, docs/runs/
threads="${LANE_THREADS:-1}"
[[ "$threads" =~ ^[1-9][0-9]*$ ]] || { echo "lane.sh: LANE_THREADS=$threads is not a number of cores (1, 2, ...)" >&2; exit 2; }
export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
while IFS= read -r line; do
  # split at every tab: with IFS=$'\t' two tabs would count as one (tab is IFS whitespace), so an empty
  # field would shift the after-command into train.py's arguments; \x1f is not whitespace
  IFS=$'\x1f' read -r name out args after <<< "${line//$'\t'/$'\x1f'}"
  [[ -z "$name" || "$name" == \#* ]] && continue
  [[ -n "$out" ]] || { echo "$(date -u +%FT%TZ) skipped $name: no OUT_DIR (the second field)"; continue; }
  # done: its record is committed (docs/runs/NAME.json; with an after-command, the record says it ran, or, for
  # records from before "after_done", NAME.extrapolation.csv is there), even in a fresh checkout without out/;
  # or its folder says so
  if [[ -f "docs/runs/$name.json" ]]; then
    [[ -z "${after:-}" ]] && continue
    if grep -q '"after_done"' "docs/runs/$name.json"; then   # a failed after-command's record says false
      grep -q '"after_done": true' "docs/runs/$name.json" && continue
    else
      [[ -f "docs/runs/$name.extrapolation.csv" ]] && continue   # a record from before "after_done"
    fi
  fi
  mkdir -p "$out"
  [[ -f "$out/metrics.json" && -f "docs/runs/$name.json" && ( -z "${after:-}" || -f "$out/after.done" ) ]] && continue
  exec {lock}> "$out/lane.lock"
  flock -n "$lock" || { exec {lock}>&-; continue; }   # another lane holds this run
  if [[ ! -f "$out/metrics.json" && "$args" =~ --init_ckpt=([^ ]+) ]]; then
    # a fine-tune (DroPE, YaRN) starts from another line's run: wait while a lane trains that run, and never
    # start from a run that has not finished (its best.pt would be an intermediate one)
    src="$(dirname "${BASH_REMATCH[1]}")"
    if [[ -d "$src" && ! -f "$src/metrics.json" ]]; then
      exec {srclock}> "$src/lane.lock"; flock "$srclock"; exec {srclock}>&-
    fi
    if [[ ! -f "$src/metrics.json" ]]; then
      echo "$(date -u +%FT%TZ) skipped $name: the run it starts from ($src) has not finished; a later lane takes it"
      exec {lock}>&-; continue
    fi
  fi
  if [[ ! -f "$out/metrics.json" ]]; then
    resume=""; [[ -f "$out/ckpt.pt" ]] && resume="--init_from=resume"
    echo "$(date -u +%FT%TZ) start $name: python train.py $args --out_dir=$out $resume"
    nice -n 19 /usr/bin/time -v -a -o "$out/time.txt" python train.py $args --out_dir="$out" $resume < /dev/null \
      >> "$out/train.log" 2>&1 || { echo "$(date -u +%FT%TZ) FAILED $name (see $out/train.log)"; exec {lock}>&-; continue; }
  fi
  if [[ -n "${after:-}" && ! -f "$out/after.done" ]]; then
    echo "$(date -u +%FT%TZ) after $name: $after"
    nice -n 19 bash -c "$after" < /dev/null >> "$out/after.log" 2>&1 && touch "$out/after.done" \
      || echo "$(date -u +%FT%TZ) FAILED after-command of $name"
  fi
  # the curve (for study/analyze_indirect.py curves once out/ is gone) and the extrapolation scores, each copied
  # atomically, then the record NAME.json last: it marks the run done, so a kill leaves nothing half-copied
  cp "$out/log.jsonl" "docs/runs/$name.log.jsonl.tmp" && mv "docs/runs/$name.log.jsonl.tmp" "docs/runs/$name.log.jsonl"
  if [[ -f "$out/extrapolate/extrapolation.csv" ]]; then
    cp "$out/extrapolate/extrapolation.csv" "docs/runs/$name.extrapolation.csv.tmp" \
      && mv "docs/runs/$name.extrapolation.csv.tmp" "docs/runs/$name.extrapolation.csv"
  fi
  for task in passkey copy; do  # eval_retrieval.py --out_dir=OUT_DIR/retrieval (study/results.py --retrieval)
    if [[ -f "$out/retrieval/$task.csv" ]]; then
      cp "$out/retrieval/$task.csv" "docs/runs/$name.$task.csv.tmp" && mv "docs/runs/$name.$task.csv.tmp" "docs/runs/$name.$task.csv"
    fi
  done
  python - "$name" "$out" <<'PY'
import json, os, re, sys
name, out = sys.argv[1:]
m = json.load(open(f"{out}/metrics.json"))
t = open(f"{out}/time.txt").read()
wall = [sum(float(x) * 60 ** i for i, x in enumerate(reversed(s.split(":"))))
        for s in re.findall(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", t)]
cpu = [float(u) + float(s) for u, s in zip(re.findall(r"User time \(seconds\): (\S+)", t),
                                           re.findall(r"System time \(seconds\): (\S+)", t))]
m["run"] = {"name": name, "out_dir": out, "wall_s_processes": wall, "cpu_s": round(sum(cpu), 1),
            "after_done": os.path.exists(f"{out}/after.done")}
sys.path.insert(0, ".")
from cli import atomic_write_json
atomic_write_json(f"docs/runs/{name}.json", m)
PY
  echo "$(date -u +%FT%TZ) done $name"
  exec {lock}>&-
done < <(awk 1 "$@")   # awk 1: every line ends with a newline, also a file's last
echo "$(date -u +%FT%TZ) lane finished"
exit 0
}
