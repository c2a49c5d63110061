"""bench/default_run.py: the newcomer's run, timed and weighed per stage from the process tree, and the table that
docs/training.md quotes, printed from the committed record, never re-typed."""
import json
import pathlib
import sys
import textwrap

from stages import bench_module

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
RECORD = ROOT / "bench" / "records" / "default_run.json"


def bench():
    return bench_module("default_run")


def test_a_process_belongs_to_the_stage_whose_script_it_runs():
    stage_of = bench().stage_of
    assert stage_of("/venv/bin/python3 ppo.py --n 5") == "ppo.py"
    assert stage_of("/venv/bin/python3 sft.py --output_dir runs/chitchat/sft --task chitchat") == "sft.py"
    assert stage_of("/venv/bin/python3 /venv/bin/accelerate launch ppo.py --n 5") is None      # the launcher
    assert stage_of("/bin/sh -c accelerate launch ppo.py --n 5") is None


def test_the_watched_tree_gives_each_stage_its_own_time_and_peak_memory(tmp_path):
    """A real process tree: 'ppo.py' holds 20 MB and starts 'sft.py', which holds 150 MB for a second; ppo.py's
    time leaves out its child's, and the run's peak is the child's."""
    (tmp_path / "sft.py").write_text("import time\nx = bytearray(150 * 2**20)\ntime.sleep(1.0)\n")
    (tmp_path / "ppo.py").write_text(textwrap.dedent(f"""\
        import subprocess, time
        x = bytearray(20 * 2**20)
        subprocess.run([{sys.executable!r}, "sft.py"], check=True)
        time.sleep(0.5)
        print("| mean gold score | 0.235 | 0.814 |")
        """))
    module = bench()
    result = module.summary(*module.run(f"{sys.executable} ppo.py", str(tmp_path))[:3])
    sft, ppo = result["stages"]["sft.py"], result["stages"]["ppo.py"]
    assert 150 <= sft["peak_mb"] < 200 and 20 <= ppo["peak_mb"] < 150
    assert result["peak_rss_mb"] == sft["peak_mb"]
    assert 0.8 <= sft["s"] < 5 and 0.3 <= ppo["s"] < sft["s"]
    assert result["final_table"] == {"mean gold score": ["0.235", "0.814"]}
    assert result["wall_s"] >= sft["s"] + ppo["s"]


def test_the_run_is_cut_into_phases_at_its_stages_and_at_the_lines_that_open_and_close_their_loops(tmp_path,
                                                                                                   monkeypatch):
    """A real process tree of three stages that print their loops' marks (progress bars with carriage returns, as
    tqdm writes them; the closing line unflushed, as accelerator.print leaves it); ppo.py's metrics.jsonl says how
    much of its loop was iterations and evaluations. Each phase is the time between its marks as stamped, and the
    phases add up to ppo.py's life. Nothing here depends on how fast the machine is: the checks compare stamps."""
    def stage(name, bar, close):
        (tmp_path / name).write_text(textwrap.dedent(f"""\
            import sys, time
            sys.stderr.write({bar!r}); sys.stderr.flush()
            time.sleep(0.2)
            sys.stderr.write("\\r" + {bar!r} + " 50%\\n"); sys.stderr.flush()     # tqdm's close: a newline
            print({close!r})          # not flushed, as accelerator.print: on time only if the bench unbuffers it
            sys.stderr.write("{name} after its loop\\n"); sys.stderr.flush()
            time.sleep(0.2)
            """))
    stage("sft.py", "sft:   0%|", "[sft] saved runs/x")
    stage("reward_model.py", "rm:   0%|", "[rm] held-out pairwise accuracy 0.800")
    rows = [{"step": 1, "time/step": 0.2}, {"step": 2, "time/step": 0.1, "time/eval": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "ppo.py").write_text(textwrap.dedent(f"""\
        import subprocess, sys, time
        for script in ("sft.py", "reward_model.py"):
            subprocess.run([{sys.executable!r}, script], check=True)
        sys.stderr.write("ppo_n5_fixed:   0%|"); sys.stderr.flush()     # named after its --output_dir
        time.sleep(0.6)
        sys.stderr.write("\\rppo_n5_fixed: 100%|"); sys.stderr.flush()
        print("[ppo] ranks in sync: True", flush=True)       # after the bar's last update, on its line
        time.sleep(0.2)
        print("metrics: metrics.jsonl")
        """))
    module = bench()
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)      # a pipe: the stages' stdout block-buffered
    wall, text, seen, lines = module.run(f"{sys.executable} ppo.py", str(tmp_path))
    at = (lambda mark: next(i for i, (_, line) in enumerate(lines) if mark in line))
    stamp = (lambda mark: lines[at(mark)][0])
    for close, after in (("[sft] saved", "sft.py after"), ("[rm] held-out", "reward_model.py after")):
        assert at(close) < at(after)        # the unflushed line came when printed, not at the stage's exit
    cut, loops = module.phases(seen, lines, module.metrics_rows(str(tmp_path), text))
    cut = dict(cut)
    sft_loop, rm_loop = (cut[f"{stage}: training loop (steps, held-out {what}, the model saved)"]
                         for stage, what in (("sft.py", "losses"), ("reward_model.py", "accuracy")))
    assert abs(sft_loop - (stamp("[sft] saved") - stamp("sft:"))) < 0.06
    assert abs(rm_loop - (stamp("[rm] held-out") - stamp("rm:"))) < 0.06
    assert cut["ppo.py: iterations (time/step summed)"] == 0.3
    assert cut["ppo.py: held-out evaluations (time/eval summed)"] == 0.2
    ppo_loop = stamp("[ppo] ranks") - stamp("ppo_n5_fixed:")
    assert abs(cut["ppo.py: the loop's logging and progress bar"] - (ppo_loop - 0.5)) < 0.06
    ppo_end = max(f["end"] for f in seen.values() if module.stage_of(f["cmd"]) == "ppo.py")
    assert abs(cut["ppo.py: final policy, report, pictures, exit"] - (ppo_end - stamp("[ppo] ranks"))) < 0.06
    assert loops == round(sft_loop + rm_loop + 0.3, 1)
    assert abs(sum(cut.values()) - ppo_end) < 0.35       # the phases cover ppo.py's life (13 rounded figures)
    assert module.phases(seen, [line for line in lines if "ranks in sync" not in line[1]], []) == ([], None)
    untimed = dict(module.phases(seen, lines, [{"step": 1, "time/step": 0.2}, {"step": 2, "time/step": 0.1}])[0])
    assert "ppo.py: held-out evaluations (time/eval summed)" not in untimed     # a commit before time/eval
    assert abs(untimed["ppo.py: held-out evaluations, logging, progress bar (no time/eval logged)"]
               - cut["ppo.py: held-out evaluations (time/eval summed)"]
               - cut["ppo.py: the loop's logging and progress bar"]) < 0.15        # the two rows' sum, rounded


def test_the_committed_record_says_what_produced_it_and_the_docs_quote_its_table():
    record = json.loads(RECORD.read_text())
    assert len(record["commit"]) == 40 and record["command"] == "accelerate launch ppo.py --n 5"
    assert set(record["stages"]) == {"sft.py", "reward_model.py", "ppo.py"} and record["cpus"] >= 1
    assert set(record["final_table"]) == set(bench().FINAL_ROWS)
    assert bench().table(record) in (ROOT / "docs" / "training.md").read_text()


def test_the_readme_quotes_the_records_whole_run_time():
    """README's "about N minutes" cites the measured run's seconds, which must be the committed record's."""
    record = json.loads(RECORD.read_text())
    assert f"({record['wall_s']:.0f} s in the [measured run" in (ROOT / "README.md").read_text()


def test_the_record_keeps_what_the_run_built(tmp_path):
    """The SFT model's last held-out loss from its log line, the RM's rm_eval.json and the PPO run's held-out curve
    from the metrics file its report names, read from the run's folder."""
    (tmp_path / "runs/chitchat/rm").mkdir(parents=True)
    (tmp_path / "runs/chitchat/rm/rm_eval.json").write_text(json.dumps({"accuracy": 0.8, "gold_pairs": 198}))
    (tmp_path / "runs/chitchat/ppo").mkdir()
    (tmp_path / "runs/chitchat/ppo/metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 1, "kl": 0.0}, {"step": 20, "eval/gold": 0.58214, "kl": 7.6851}, {"step": 40, "eval/gold": 0.7, "kl": 9.0})))
    text = ("sft:  50%|##| 100/200\r[sft] step 100/200  train loss 5.5  held-out loss 5.600  ppl 270.4  (20s)\n"
            "[sft] step 200/200  train loss 5.2  grad norm 0.7  held-out loss 5.329  ppl 206.1  (43s)\n"
            "metrics: runs/chitchat/ppo/metrics.jsonl\n")
    built = bench().built_models(str(tmp_path), text)
    assert built == {"sft_held_out_loss": {"step": 200, "loss": 5.329}, "rm_eval": {"accuracy": 0.8, "gold_pairs": 198},
                     "curve": [[20, 0.5821, 7.685], [40, 0.7, 9.0]]}
    assert bench().built_models(str(tmp_path / "nothing"), "") == {}


def test_the_docs_quote_the_records_built_models():
    """docs/training.md's figures about the default run's models are the record's (line breaks aside)."""
    m = json.loads(RECORD.read_text())["models"]
    docs = " ".join((ROOT / "docs" / "training.md").read_text().split())
    sft, rm, curve = m["sft_held_out_loss"], m["rm_eval"], m["curve"]
    best, last = max(curve, key=lambda row: row[1]), curve[-1]
    for quoted in (f"held-out loss is {sft['loss']:.3f} at step {sft['step']}", f"held-out accuracy {rm['accuracy']:.3f}",
                   f"RM-gold agreement {rm['gold_agreement']:.3f} on {rm['gold_pairs']} pairs",
                   f"rises to {best[1]:.3f} at iteration {best[0]} and is {last[1]:.3f} at {last[0]}"):
        assert quoted in docs


def test_the_records_phases_add_up_and_the_docs_quote_its_overhead():
    """The committed record's phases cover its run (up to the launcher's exit), its overhead is the run less its three
    training loops, and docs/training.md's paragraph on it quotes those figures."""
    record = json.loads(RECORD.read_text())
    phases = dict(record["phases"])
    assert abs(sum(phases.values()) - record["wall_s"]) < 1.5
    assert record["overhead_s"] == round(record["wall_s"] - record["loops_s"], 1)
    evaluations = phases["ppo.py: held-out evaluations (time/eval summed)"]
    docs = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert (f"Of the record's {record['wall_s']:.0f} s, {record['loops_s']} s are the three training loops (SFT's "
            f"and the RM's with their final saves) and {record['overhead_s']} s the rest") in docs
    assert f"the held-out evaluations, {evaluations} s" in docs
