"""study/results.py --compare --retrieval: eval_retrieval.py's passkey and copy accuracies per run, compared
between two arms like the other metrics (values by hand, the test against scipy), and bad input."""

import csv

import pytest
from scipy import stats
from test_results_compare import arms

import results


def write_retrieval(path, passkey, copy_acc, length=256):
    """NAME.passkey.csv (two depths: correct per depth out of 10) and NAME.copy.csv beside NAME.json."""
    stem = path[: -len(".json")]
    with open(f"{stem}.passkey.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "label", "length", "depth", "trials", "correct"])
        for depth, k in zip((0.0, 1.0), passkey):
            w.writerow([stem, "rope", length, depth, 10, k])
    with open(f"{stem}.copy.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "label", "length", "distance", "acc_second"])
        w.writerow([stem, "rope", length, length // 2 + 1, copy_acc])


def test_compare_reads_pooled_passkey_and_copy_accuracy(tmp_path):
    paths = arms(tmp_path, [1.0, 1.1, 1.2], [1.0, 1.1, 1.3], seeds_b=[7, 8, 9])
    passkey = [(2, 4), (5, 5), (0, 3), (9, 10), (10, 10), (7, 9)]  # pooled: 30 %, 50 %, 15 %; 95 %, 100 %, 80 %
    copies = [0.10, 0.12, 0.08, 0.50, 0.61, 0.55]
    for p, k, c in zip(paths, passkey, copies):
        write_retrieval(p, k, c)
    c = results.compare(paths, "pos_encoding", retrieval=results.parse_retrieval("passkey@256,copy@256"))
    pk = next(r for r in c["rows"] if r["metric"] == "passkey acc (%) at 256")
    a, b = [30.0, 50.0, 15.0], [95.0, 100.0, 80.0]
    assert pk["a"][0] == pytest.approx(sum(a) / 3) and pk["b"][0] == pytest.approx(sum(b) / 3)
    assert pk["welch"][2] == pytest.approx(stats.ttest_ind(b, a, equal_var=False).pvalue)
    cp = next(r for r in c["rows"] if r["metric"] == "copy acc (%) at 256")
    assert cp["b"][0] - cp["a"][0] == pytest.approx(100 * (sum(copies[3:]) - sum(copies[:3])) / 3)


@pytest.mark.parametrize(
    "arg,message",
    [
        ("--retrieval=needle@256", "TASK@LENGTH"),
        ("--retrieval=passkey@0", "TASK@LENGTH"),
        ("--retrieval=passkey@512", "has no length 512"),
    ],
)
def test_bad_retrieval_input_exits_2(tmp_path, capsys, arg, message):
    paths = arms(tmp_path, [1.0, 1.1], [1.0, 1.2])
    for p in paths:
        write_retrieval(p, (1, 1), 0.1)
    with pytest.raises(SystemExit) as e:
        results.main(paths + ["--compare=pos_encoding", arg])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_retrieval_needs_compare_and_the_csv(tmp_path, capsys):
    paths = arms(tmp_path, [1.0, 1.1], [1.0, 1.2])
    with pytest.raises(SystemExit):
        results.main(paths + ["--retrieval=passkey@256"])
    assert "--compare" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        results.main(paths + ["--compare=pos_encoding", "--retrieval=copy@256"])
    assert "has no copy results" in capsys.readouterr().err


def test_a_csv_of_several_runs_of_one_label_gives_each_run_its_own_rows(tmp_path):
    """eval_retrieval.py run once on all seeds of an arm writes one CSV whose rows share a label ("rope")
    and differ in run folder; each record (NAME.json, its run folder out/NAME) holds that whole CSV. Each run
    reads its own rows, matched by run folder (a trailing slash in the CSV's run column included): passkey
    pooled over its own depths, copy its own acc_second, never another run's nor a pool of all."""
    paths = arms(tmp_path, [1.0, 1.1, 1.2], [1.0, 1.1, 1.3], seeds_b=[7, 8, 9])
    names = ["pope-s1", "pope-s2", "pope-s3", "rope-s7", "rope-s8", "rope-s9"]
    passkey = {
        "pope-s1": (2, 4),
        "pope-s2": (5, 5),
        "pope-s3": (0, 3),
        "rope-s7": (9, 10),
        "rope-s8": (10, 10),
        "rope-s9": (7, 9),
    }
    copies = dict(zip(names, [0.10, 0.12, 0.08, 0.50, 0.61, 0.55]))
    pk_text = "run,label,length,depth,trials,correct\n" + "".join(
        f"out/{n}{'/' if n.endswith('2') else ''},rope,{L},{d},10,{k if L == 256 else 10 - k}\n"
        for n in names
        for L in (128, 256)
        for d, k in zip((0.0, 1.0), passkey[n])
    )
    cp_text = "run,label,length,distance,acc_second\n" + "".join(
        f"out/{n},rope,{L},{L // 2 + 1},{copies[n] if L == 256 else 1 - copies[n]}\n" for n in names for L in (128, 256)
    )
    for p in paths:
        stem = p[: -len(".json")]
        open(f"{stem}.passkey.csv", "w").write(pk_text)
        open(f"{stem}.copy.csv", "w").write(cp_text)
    for p, n in zip(paths, names):
        run = results.load_run(p)
        assert results.retrieval_accuracy(run, "passkey", 256) == pytest.approx(sum(passkey[n]) / 20)
        assert results.retrieval_accuracy(run, "passkey", 128) == pytest.approx(1 - sum(passkey[n]) / 20)
        assert results.retrieval_accuracy(run, "copy", 256) == pytest.approx(copies[n])
    c = results.compare(paths, "pos_encoding", retrieval=results.parse_retrieval("passkey@256,copy@256"))
    pk = next(r for r in c["rows"] if r["metric"] == "passkey acc (%) at 256")
    assert pk["a"][0] == pytest.approx(100 * (6 / 20 + 10 / 20 + 3 / 20) / 3)
    assert pk["b"][0] == pytest.approx(100 * (19 / 20 + 20 / 20 + 16 / 20) / 3)
    cp = next(r for r in c["rows"] if r["metric"] == "copy acc (%) at 256")
    assert cp["a"][0] == pytest.approx(100 * 0.30 / 3) and cp["b"][0] == pytest.approx(100 * 1.66 / 3)
