"""A newcomer's first run, measured: the README's command on a fresh clone, models not yet built.

    python bench/default_run.py [--record bench/records/default_run.json] [--command "accelerate launch ppo.py --n 5"]
    python bench/default_run.py --show bench/records/default_run.json    # the committed record's table

Clones this repository's HEAD (committed files only, as a user would get them) into a temporary folder and runs the
command there with this interpreter's environment (its `accelerate`, already installed: the install is timed apart,
`pip install -r requirements.txt`). While it runs, the process tree is read from /proc every 0.1 s: each process's
command, when it appeared and ended, and its peak resident memory (VmHWM). The table gives the whole run's wall time,
each stage's (sft.py, reward_model.py, and ppo.py less the two it started), the peak RSS of the largest process
(the figure `/usr/bin/time -v` reports for the tree) and of each stage, and the run's final table; the record also
keeps what the run built (the SFT model's held-out loss, the RM's rm_eval.json, the PPO run's held-out curve).

The output is read as it comes, each line (and each progress-bar update) stamped with its second: the run is cut
into phases at the stages' starts and ends and at the lines that open and close each training loop (BAR, LOOP_MARKS),
ppo.py's loop further into its iterations (`time/step` summed from its metrics.jsonl), its held-out evaluations
(`time/eval`) and the rest. What lies outside the three training loops (start-ups, data, tokenizer, the builds'
evaluations, ppo.py's held-out evaluations and report) is the run's overhead, `overhead_s` in the record.

--record writes all that with what it depends on (commit, command, CPUs, threads, load average, versions);
docs/training.md's "measured default run" is the `--show` output of bench/records/default_run.json.
"""
import argparse
import codecs
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("sft.py", "reward_model.py", "ppo.py")
FINAL_ROWS = ("mean RM score", "mean gold score", "gold win rate vs SFT (ties half)")


def descendants(pid):
    """The pids below `pid` (children, grandchildren, ...) that are still there."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def peek(pid):
    """(command line, VmHWM kB) of a live process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return cmd, hwm
    except (OSError, StopIteration):
        return None


def stage_of(cmd):
    """Which stage a process runs (the script named in its command line), or None (the launcher, helpers)."""
    words = cmd.split()
    return next((s for s in STAGES for w in words[1:3] if os.path.basename(w) == s), None)


def stamped_reader(stream, log, lines, t0):
    """Copy `stream` (the run's merged stdout and stderr, bytes) to the file `log`, appending (seconds since `t0`,
    text) to `lines` for each piece that ends in a newline or a carriage return (a progress bar's update), stamped
    when its first byte came (a bar is drawn, then left unfinished until its next update)."""
    pending, since, decoder = b"", None, codecs.getincrementaldecoder("utf-8")(errors="replace")
    for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
        now = time.time() - t0
        log.write(decoder.decode(chunk))        # a character cut between two reads is kept whole
        pieces = re.split(rb"[\r\n]", pending + chunk)
        stamps = [now if pending == b"" or since is None else since] + [now] * (len(pieces) - 1)
        pending, since = pieces.pop(), stamps.pop()
        lines += [(t, piece.decode(errors="replace")) for t, piece in zip(stamps, pieces) if piece.strip()]
    if pending.strip():
        lines.append((since, pending.decode(errors="replace")))
    log.flush()


def run(command, cwd):
    """Run `command` in `cwd`, watching its process tree: (wall s, stdout text, {pid: facts}, [(s, line)]): the
    output's lines stamped with when they came (progress bars' updates each a line of its own)."""
    seen, lines, t0 = {}, [], time.time()
    out = open(os.path.join(cwd, "default_run.log"), "w+")
    proc = subprocess.Popen(command, shell=True, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})   # lines on time
    reader = threading.Thread(target=stamped_reader, args=(proc.stdout, out, lines, t0), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            now = time.time() - t0
            for pid in [proc.pid] + descendants(proc.pid):
                facts = peek(pid)
                if facts:
                    entry = seen.setdefault(pid, {"cmd": facts[0], "start": now, "peak_kb": 0})
                    if facts[0] != entry["cmd"]:    # seen between fork and exec: the parent's command and memory
                        entry.update(cmd=facts[0], peak_kb=0)
                    entry.update(end=now, peak_kb=max(entry["peak_kb"], facts[1]))
            time.sleep(0.1)
    except KeyboardInterrupt:
        os.killpg(proc.pid, 2)
        raise
    wall = time.time() - t0
    reader.join(timeout=30)     # a leftover grandchild holding the pipe open does not hang the bench
    out.seek(0)
    text = out.read()
    if proc.returncode:
        sys.exit(f"error: {command!r} exited with {proc.returncode}; its log: {out.name}\n{text[-3000:]}")
    return wall, text, seen, lines


def summary(wall, text, seen):
    """The record's figures from a run's output and its watched processes."""
    stages = {}
    for facts in seen.values():
        stage = stage_of(facts["cmd"])
        if stage:
            s = stages.setdefault(stage, {"s": 0.0, "peak_mb": 0})
            s["s"] += facts["end"] - facts["start"]
            s["peak_mb"] = max(s["peak_mb"], round(facts["peak_kb"] / 1024))
    if "ppo.py" in stages:       # ppo.py waits while sft.py and reward_model.py (its children) run
        stages["ppo.py"]["s"] -= sum(stages[s]["s"] for s in ("sft.py", "reward_model.py") if s in stages)
    final = {}
    for row in FINAL_ROWS:
        match = re.search(rf"^\| {re.escape(row)} \|([^|]*)\|([^|]*)\|", text, re.M)
        if match:
            final[row] = [cell.strip() for cell in match.groups()]
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(max(f["peak_kb"] for f in seen.values()) / 1024),
            "stages": {k: {"s": round(v["s"], 1), "peak_mb": v["peak_mb"]} for k, v in stages.items()},
            "final_table": final}


# Where each stage's training loop starts and ends in the output: the first progress bar drawn after the loop before it
# closed (tqdm's "<name>:   0%|"; ppo.py's is named after its --output_dir), and the line it prints after its last step.
BAR = r"\S+:\s+\d+%\|"
LOOP_MARKS = {"sft.py": r"\[sft\] saved ", "reward_model.py": r"\[rm\] held-out pairwise accuracy",
              "ppo.py": r"\[ppo\] ranks in sync"}


def phases(seen, lines, metrics_rows):
    """The run's wall time cut at its stages' start and end (the process tree) and at the lines that open and close
    each training loop (BAR, LOOP_MARKS, stamped as they came): [(phase, seconds)], in order, and the seconds of the
    three training loops (SFT's and the RM's steps with their held-out evaluations, and ppo.py's iterations: their
    `time/step` summed from `metrics_rows`, evaluations and logging left out). ppo.py's loop is cut further into its
    held-out evaluations (`time/eval` summed) and the rest. ([], None) when a mark is missing."""
    span = {}
    for facts in seen.values():
        stage = stage_of(facts["cmd"])
        if stage:
            lo, hi = span.get(stage, (facts["start"], facts["end"]))
            span[stage] = (min(lo, facts["start"]), max(hi, facts["end"]))
    if set(span) != set(STAGES):
        return [], None
    (sft_in, sft_out), (_, rm_out), (ppo_in, ppo_out) = (span[s] for s in STAGES)
    marks, start = {}, 0
    for stage in ("sft.py", "reward_model.py", "ppo.py"):     # each loop's bar: the first after the loop before it
        opened = next((i for i in range(start, len(lines)) if re.match(BAR, lines[i][1].strip())), None)
        closed = next((i for i in range(opened or 0, len(lines)) if re.search(LOOP_MARKS[stage], lines[i][1])), None)
        if opened is None or closed is None:
            return [], None
        marks[stage, "open"], marks[stage, "close"], start = lines[opened][0], lines[closed][0], closed + 1
    ppo_loop = marks["ppo.py", "close"] - marks["ppo.py", "open"]
    steps = sum(r.get("time/step", 0.0) for r in metrics_rows)
    evals = sum(r.get("time/eval", 0.0) for r in metrics_rows)
    timed = any("time/eval" in r for r in metrics_rows)    # a commit before time/eval: evaluations not told apart
    cut = [("accelerate launch, until ppo.py starts", ppo_in),
           ("ppo.py: imports, accelerator, config", sft_in - ppo_in),
           ("sft.py: imports, data, tokenizer, model", marks["sft.py", "open"] - sft_in),
           ("sft.py: training loop (steps, held-out losses, the model saved)",
            marks["sft.py", "close"] - marks["sft.py", "open"]),
           ("sft.py: samples, exit", sft_out - marks["sft.py", "close"]),
           ("reward_model.py: start, imports, labelled data, model", marks["reward_model.py", "open"] - sft_out),
           ("reward_model.py: training loop (steps, held-out accuracy, the model saved)",
            marks["reward_model.py", "close"] - marks["reward_model.py", "open"]),
           ("reward_model.py: RM-gold agreement, exit", rm_out - marks["reward_model.py", "close"]),
           ("ppo.py: models, data, optimizers", marks["ppo.py", "open"] - rm_out),
           ("ppo.py: iterations (time/step summed)", steps),
           *([("ppo.py: held-out evaluations (time/eval summed)", evals),
              ("ppo.py: the loop's logging and progress bar", ppo_loop - steps - evals)] if timed else
             [("ppo.py: held-out evaluations, logging, progress bar (no time/eval logged)", ppo_loop - steps)]),
           ("ppo.py: final policy, report, pictures, exit", ppo_out - marks["ppo.py", "close"])]
    loops = cut[3][1] + cut[6][1] + steps
    return [(name, round(s, 1)) for name, s in cut], round(loops, 1)


def metrics_rows(clone, text):
    """The rows of the metrics.jsonl that the run's report names (`metrics: <path>`), [] if none."""
    metrics = re.findall(r"^metrics: (\S+)$", text, re.M)
    if not metrics or not os.path.exists(os.path.join(clone, metrics[-1])):
        return []
    with open(os.path.join(clone, metrics[-1])) as f:
        return [json.loads(line) for line in f]


def built_models(clone, text):
    """The figures of what the run built and trained, from the clone: the SFT model's last held-out loss (its log
    line), the RM's rm_eval.json, and the PPO run's held-out curve [(iteration, eval/gold, KL)] (its metrics.jsonl)."""
    out = {}
    losses = re.findall(r"\[sft\] step (\d+)/\d+ .*?held-out loss ([0-9.]+)", text)
    if losses:
        out["sft_held_out_loss"] = {"step": int(losses[-1][0]), "loss": float(losses[-1][1])}
    rm_eval = os.path.join(clone, "runs", "chitchat", "rm", "rm_eval.json")
    if os.path.exists(rm_eval):
        out["rm_eval"] = json.load(open(rm_eval))
    rows = metrics_rows(clone, text)
    if rows:
        out["curve"] = [[r["step"], round(r["eval/gold"], 4), round(r["kl"], 3)] for r in rows if "eval/gold" in r]
    return out


def table(record):
    """The markdown the docs quote: the run's time and memory by stage, its final table, and its phases."""
    s = record["stages"]
    lines = [f"`{record['command']}` on a fresh clone of {record['commit'][:7]}, {record['cpus']} CPUs, "
             f"{record['threads']} threads, load average {record['load_average'][0]} at the start:", "",
             "| | whole run | sft.py | reward_model.py | ppo.py (120 iterations, evaluations, report) |", "|---|---|---|---|---|",
             f"| wall time | **{record['wall_s']:.0f} s** | " + " | ".join(f"{s[k]['s']:.0f} s" for k in STAGES) + " |",
             f"| peak RSS | **{record['peak_rss_mb']} MB** | " + " | ".join(f"{s[k]['peak_mb']} MB" for k in STAGES) + " |",
             "", "| held-out (256 prompts) | SFT | policy |", "|---|---|---|"]
    lines += [f"| {row} | {sft} | {policy} |" for row, (sft, policy) in record["final_table"].items()]
    if record.get("phases"):        # records from before the output was stamped have no phases
        lines += ["", "| phase of the run | s |", "|---|---|"]
        lines += [f"| {name} | {s:.1f} |" for name, s in record["phases"]]
        lines += [f"| **the three training loops** | **{record['loops_s']:.1f}** |",
                  f"| **outside them** | **{record['overhead_s']:.1f}** |"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", default="accelerate launch ppo.py --n 5", help="what a newcomer runs (README)")
    parser.add_argument("--record", default="", help="write the record (JSON) here")
    parser.add_argument("--show", default="", help="print the table of a record written by --record, and exit")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its runs/ and default_run.log)")
    parser.add_argument("--rev", default="HEAD", help="the commit to clone and run (e.g. an older one, for a before / after "
                        "pair in one sitting)")
    cli = parser.parse_args()
    if cli.show:
        print(table(json.load(open(cli.show))))
        return
    import torch
    import transformers
    git = (lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, check=True).stdout.strip())
    clone = os.path.join(tempfile.mkdtemp(prefix="default_run_"), "ma-rlhf")
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "-q", cli.rev], check=True)
    env_bin = os.path.dirname(sys.executable)            # this environment's accelerate and python come first
    command = f"PATH={env_bin}:$PATH {cli.command}"
    record = {"command": cli.command, "bench": " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "commit": git("rev-parse", cli.rev),
              "dirty": cli.rev == "HEAD" and bool(git("status", "--porcelain", "--untracked-files=no")),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
              "threads": torch.get_num_threads(), "load_average": [round(x, 2) for x in os.getloadavg()],
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    print(f"[default_run] {cli.command!r} in {clone} ...", flush=True)
    wall, text, seen, lines = run(command, clone)
    record.update(summary(wall, text, seen), models=built_models(clone, text))
    cut, loops = phases(seen, lines, metrics_rows(clone, text))
    record.update(phases=cut, loops_s=loops, overhead_s=None if loops is None else round(wall - loops, 1))
    record["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(table(record))
    if cli.record:
        with open(cli.record, "w") as f:
            json.dump(record, f, indent=1)
        print(f"record: {cli.record}")
    if not cli.keep:
        subprocess.run(["rm", "-rf", os.path.dirname(clone)])


if __name__ == "__main__":
    main()
