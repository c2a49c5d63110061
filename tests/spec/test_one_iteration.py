"""docs/one_iteration.md is what ppo.main() computes: the page regenerated from a recorded run of main() on the tiny
models (bench/one_iteration.py) must equal the committed one, and its tables must hold Eq. 4-5 by hand."""
import re

import pytest
import torch

from reference import macro_gae_loop
from stages import bench_module

one_iteration = bench_module("one_iteration")
NUMBER = re.compile(r"-?\d+\.\d+")


@pytest.fixture(scope="module")
def recorded():
    """(the shown iteration's calls, its metrics row, main's args, the tokenizer, the command): one run of main()."""
    return one_iteration.record()


def committed():
    return open(one_iteration.PAGE, encoding="utf-8").read()


def same_but_rounding(a, b):
    """The texts are equal, their decimal numbers within one unit of their last digit (a last digit may round the
    other way on another CPU)."""
    if NUMBER.split(a) != NUMBER.split(b):
        return False
    return all(abs(float(x) - float(y)) <= 1.01 * 10 ** -len(x.split(".")[1])
               for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)))


def test_the_committed_page_is_what_the_code_gives(recorded):
    text = one_iteration.page(*recorded)
    assert same_but_rounding(committed(), text), \
        "docs/one_iteration.md differs from what the code gives: run python bench/one_iteration.py"


def test_same_but_rounding_tells_a_changed_number_or_line():
    assert same_but_rounding("V 0.0414 at t 3", "V 0.0415 at t 3")
    assert not same_but_rounding("V 0.0414 at t 3", "V 0.0417 at t 3")
    assert not same_but_rounding("V 0.0414 at t 3", "V 0.0414 at t 4")


def macro_tables(text):
    """Each shown sample's per-token rows (t, r_t, ...) and per-macro rows (tau, tokens, R, V, delta, A, return)."""
    samples = {}
    for name, kind, body in re.findall(r"\*\*Sample (\w)\*\*, per (token|macro action)[^\n]*\n\n((?:\|.*\n)+)", text):
        rows = [line.strip("|").split("|") for line in body.strip().splitlines()[2:]]
        samples.setdefault(name, {})[kind] = [[c.strip() for c in r] for r in rows]
    return samples


def test_the_page_tables_hold_eq_4_5_by_hand():
    """What a learner checks on the page, to its rounding: R_tau is the sum of its tokens' r_t, the last delta is
    R - V, each A_tau = delta_tau + gamma lambda A_tau+1 (gamma lambda = 0.95), each return = A + V."""
    samples = macro_tables(committed())
    assert sorted(samples) == ["A", "B"]
    for tables in samples.values():
        tokens, macros = tables["token"], tables["macro action"]
        assert len(macros) >= 2
        for tau, span, R, V, delta, A, ret in macros:
            first, last = map(int, span.split("-"))
            assert float(R) == pytest.approx(sum(float(r[1]) for r in tokens[first:last + 1]), abs=2e-6)
            assert float(ret) == pytest.approx(float(A) + float(V), abs=2e-4)
        R, V, delta, A = (float(x) for x in macros[-1][2:6])
        assert delta == pytest.approx(R - V, abs=2e-4) and A == pytest.approx(delta, abs=1e-4)
        for now, after in zip(macros, macros[1:]):
            assert float(now[5]) == pytest.approx(float(now[4]) + 0.95 * float(after[5]), abs=3e-4)


def test_the_advantages_are_macro_gae_of_a_plain_loop(recorded):
    """Every row of the recorded batch (not only the two shown): main()'s macro_advantages against a loop."""
    calls = recorded[0]
    (values, rewards, mask, starts, gamma, lam, sigma), _, (advantages, returns) = calls["macro_advantages"][0]
    adv, ret = macro_gae_loop(values, rewards, mask, starts, gamma, lam, sigma)
    assert torch.allclose(advantages, adv, atol=1e-6) and torch.allclose(returns, ret, atol=1e-6)


def test_the_recorded_tensors_are_the_logged_iteration(recorded):
    """The recorder kept the iteration that metrics.jsonl logged as the second: its score and KL means are those."""
    calls, metrics = recorded[:2]
    assert metrics["step"] == one_iteration.SHOWN + 1
    mask = calls["cut_after_eos"][0][2][1].float()
    kl = one_iteration.policy_call(calls["response_logprobs"])[2][0].detach() - calls["reference_logprobs"][0][2][0]
    assert metrics["kl"] == pytest.approx(float((kl * mask).sum(-1).mean()), abs=1e-4)
    assert metrics["reward/rm"] == pytest.approx(float(calls["__call__"][0][2][0].mean()), abs=1e-4)
    assert float(kl.abs().max()) > 0     # the policy moved in the first iteration: a KL to show


def test_code_that_moved_stops_the_page():
    import macro_actions as ma
    with pytest.raises(ValueError, match="whiten: no line holds"):
        one_iteration.code(ma.whiten, "a line that is not there")
    assert "# 5. Advantages" in one_iteration.step(5) and "# 6." not in one_iteration.step(5)
