"""The real-model cost guard: bench/real_ppo.py's record (medians, peak RSS, commit, command) and the table of
docs/real_models.md, which is printed from the committed record, never re-typed."""
import json
import pathlib
import re

from stages import bench_module

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
RECORD = ROOT / "bench" / "records" / "real_ppo.json"


def real_ppo():
    return bench_module("real_ppo")


def iteration(total, forwards, length):
    return {"generate": 1.0, "forwards": forwards, "update": 2.0, "total": total, "response_len": length,
            "cpu": {"generate": 2.0, "forwards": 2 * forwards, "update": 4.0, "total": 2 * total}}


def test_a_side_summary_is_the_median_of_the_iterations_after_the_warm_up():
    its = [iteration(100.0, 90.0, 10), iteration(30.0, 12.0, 40), iteration(34.0, 16.0, 42), iteration(31.0, 13.0, 38)]
    summary = real_ppo().side_summary({"iterations": its, "peak_rss_mb": 8437.4, "wall_s": 250.2, "threads": 2,
                                       "versions": {"torch": "x"}})
    assert summary["median_s"]["total"] == {"wall": 31.0, "cpu": 62.0}         # 100 s of warm-up left out
    assert summary["median_s"]["forwards"] == {"wall": 13.0, "cpu": 26.0}
    assert summary["response_len"] == 40 and summary["peak_rss_mb"] == 8437 and summary["threads"] == 2
    assert summary["iterations"] == its


def test_the_committed_record_says_what_produced_it():
    record = json.loads(RECORD.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and record["command"].startswith("python bench/real_ppo.py")
    assert set(record["weights_sha256"]) == {"sft", "rm"} and record["cpus"] >= 1
    for side in record["sides"].values():
        assert side["peak_rss_mb"] > 0 and side["threads"] >= 1 and "torch" in side["versions"]
        assert len(side["iterations"]) == record["sizes"]["steps"]
        assert all(side["median_s"][k]["wall"] > 0 for k in ("generate", "forwards", "update", "total"))


def test_real_models_table_is_printed_from_the_committed_record():
    table = real_ppo().table(json.loads(RECORD.read_text()))
    assert table in (ROOT / "docs" / "real_models.md").read_text()
