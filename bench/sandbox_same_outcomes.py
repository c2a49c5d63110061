"""Honest programs keep their outcomes: a corpus run under this sandbox.py and another, outcome and test counts
compared program by program.

    python bench/sandbox_same_outcomes.py --against OTHER/sandbox.py     # git show REV:sandbox.py > old.py

The corpus: the 164 HumanEval canonical solutions and 40 wrong completions (`return None`); 150 reference bodies of
the embedded `code` task and 150 wrong ones (the next problem's body: wrong values, or a NameError); the APPS
fixtures' solutions and a wrong answer to each (`print(0)`, or a function returning None). Prints the programs whose
outcome or counts differ, and a summary line.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import sandbox  # noqa: E402


def corpus():
    """[(name, program, tests)]."""
    jobs = []
    problems = data.humaneval_problems()
    jobs += [(p["task_id"], p["prompt"] + p["canonical_solution"], p["tests"]) for p in problems]
    jobs += [(p["task_id"] + " wrong", p["prompt"] + "    return None\n", p["tests"]) for p in problems[:40]]
    rows = data.code_problems(n=151)
    jobs += [(f"code {i}", row["prefix"] + row["chosen"], row["tests"]) for i, row in enumerate(rows[:150])]
    jobs += [(f"code {i} wrong", row["prefix"] + rows[i + 1]["chosen"], row["tests"])
             for i, row in enumerate(rows[:150])]
    for name in ("apps_train.jsonl", "apps_test.jsonl"):
        with open(os.path.join(ROOT, "tests", "fixtures", name)) as f:
            for line in f:
                row = json.loads(line)
                io = json.loads(row["input_output"])
                tests = {"inputs": io["inputs"], "outputs": io["outputs"],
                         **({"fn_name": io["fn_name"]} if io.get("fn_name") else {})}
                wrong = f"def {io['fn_name']}(*args):\n    return None\n" if io.get("fn_name") else "print(0)\n"
                for i, solution in enumerate(json.loads(row["solutions"])):
                    jobs.append((f"apps {row['problem_id']} solution {i}", solution, tests))
                jobs.append((f"apps {row['problem_id']} wrong", wrong, tests))
    return jobs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the other sandbox.py")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("sandbox_other", args.against)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    jobs = corpus()
    results = {}
    for label, module in ((args.against, other), ("sandbox.py", sandbox)):
        start = time.time()
        results[label] = module.run_many([(program, tests) for _, program, tests in jobs])
        print(f"{label}: {len(jobs)} programs in {time.time() - start:.0f} s")
    differ = 0
    for (name, _, _), a, b in zip(jobs, results[args.against], results["sandbox.py"]):
        if (a.outcome, a.passed, a.failed) != (b.outcome, b.passed, b.failed):
            differ += 1
            print(f"  {name}: {a.outcome} {a.passed}/{a.failed} ({a.detail[:60]!r}) against "
                  f"{b.outcome} {b.passed}/{b.failed} ({b.detail[:60]!r})")
    outcomes = {}
    for r in results["sandbox.py"]:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    print(f"{len(jobs) - differ} of {len(jobs)} programs with the same outcome and counts; here: {outcomes}")


if __name__ == "__main__":
    main()
