"""fedpilot.stats against published numbers and measured coverage: the paired t interval of Student's sleep data,
Holm's adjusted p-values on a textbook example, the seeds a difference needs against G*Power's sample size and a
simulation, the hierarchical bootstrap's coverage on synthetic federations (and where each interval misses what the
other holds), the verdicts Holm resolves, the winner's curse, and the labels of searched keys."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fedpilot.stats.intervals import (
    bootstrap_interval,
    bootstrap_pvalue,
    crossed_draws,
    holm,
    holm_levels,
    nested_draws,
    seeds_needed,
    t_interval,
    t_power,
    t_pvalue,
)
from fedpilot.stats.keys import key_labels
from fedpilot.stats.scores import sample_steps, summarize
from fedpilot.stats.study import study_summary
from fedpilot.stats.table import format_verdicts, hull, pipelines_rows, tuning_rows
from fedpilot.stats.verdicts import optimism, verdicts

# Student (1908), "The probable error of a mean", Biometrika 6(1): extra hours of sleep of 10 patients under two
# drugs (Cushny and Peebles), as R ships it (`sleep`); per patient drug 2 minus drug 1. R's documented
# `t.test(extra ~ group, data = sleep, paired = TRUE)`: t = -4.0621, df = 9, p-value = 0.002833, 95 percent
# confidence interval -2.4598858 -0.7001142, mean difference -1.58 (drug 1 minus drug 2).
SLEEP_DIFFERENCES = np.array([1.2, 2.4, 1.3, 1.3, 0.0, 1.0, 1.8, 0.8, 4.6, 1.4])


def mean_of(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=-1)


def test_the_paired_t_interval_of_students_sleep_data():
    interval = t_interval(SLEEP_DIFFERENCES)
    assert (interval.low, interval.high) == pytest.approx((0.7001142, 2.4598858), abs=1e-7)
    assert t_pvalue(SLEEP_DIFFERENCES) == pytest.approx(0.002833, abs=5e-7)
    wider = t_interval(SLEEP_DIFFERENCES, alpha=0.01)  # a smaller alpha: a wider interval around the same mean
    assert wider.low < interval.low and wider.high > interval.high
    assert (wider.low + wider.high) / 2 == pytest.approx(1.58)
    assert math.isnan(t_pvalue(np.array([0.3]))) and math.isnan(t_interval(np.array([0.3])).low)  # one seed
    assert t_pvalue(np.array([0.2, 0.2])) == 0.0 and t_interval(np.array([0.2, 0.2])).low == 0.2  # no spread


def test_holm_adjusts_the_textbook_example():
    """Holm (1979), Scand. J. Statist. 6: 65-70; the worked example of the Holm-Bonferroni method (four hypotheses,
    p = 0.01, 0.04, 0.03, 0.005 at alpha = 0.05: H4 and H1 are rejected, then 0.03 > 0.05/2 stops the steps)."""
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])  # 3 x 0.01; max(2 x 0.03, ...); 4 x 0.005
    assert [a <= 0.05 for a in holm(p)] == [True, False, False, True]
    # each interval at the level its step tested it at; once the steps stop (after 2), the others at alpha / 2
    assert holm_levels(p) == pytest.approx([0.05 / 3, 0.05 / 2, 0.05 / 2, 0.05 / 4])
    assert holm([0.5, float("nan")]) == [1.0, 1.0]  # no test counts as p = 1 and still counts in m
    assert holm([0.02]) == [0.02] and holm_levels([0.02]) == [0.05]  # one comparison: nothing to adjust


def test_an_adjusted_interval_excludes_zero_exactly_when_holm_rejects():
    """On random families of paired differences: the t interval at each comparison's Holm level excludes 0 exactly
    when the step-down rejects (the intervals are the tests' duals), and the bootstrap's likewise."""
    rng = np.random.default_rng(3)
    agreed = 0
    for _ in range(40):
        family = [rng.normal(rng.choice([0.0, 0.01, 0.03]), 0.01, size=4) for _ in range(5)]
        p = [t_pvalue(d) for d in family]
        for diffs, adjusted, level in zip(family, holm(p), holm_levels(p), strict=True):
            interval = t_interval(diffs, level)
            assert (adjusted <= 0.05) == (interval.low > 0 or interval.high < 0)
            agreed += adjusted <= 0.05
        draws = rng.normal(rng.uniform(-0.01, 0.03), 0.01, size=999)
        for level in (0.05, 0.0125, 0.01):
            interval = bootstrap_interval(draws, level)
            assert (bootstrap_pvalue(draws) <= level) == (interval.low > 0 or interval.high < 0)
    assert 0 < agreed < 200  # both outcomes were seen


def test_seeds_needed_matches_a_direct_power_calculation():
    """G*Power (Faul et al., Behavior Research Methods 2007), one-sample / paired t test, two-tailed alpha = 0.05,
    power 0.80: d = 0.5 needs N = 34 (actual power 0.808), d = 0.8 needs 15, d = 0.2 needs 199."""
    assert [seeds_needed(1.0, d, 0.05) for d in (0.5, 0.8, 0.2)] == [34, 15, 199]
    assert t_power(34, 0.5, 0.05) == pytest.approx(0.8078, abs=1e-4) and t_power(33, 0.5, 0.05) < 0.8
    # 0.5 pp at a measured sd of 0.4 pp, at Holm's first level for 3 comparisons; then simulated
    n = seeds_needed(0.004, 0.005, 0.05 / 3)
    assert t_power(n, 1.25, 0.05 / 3) >= 0.8 > t_power(n - 1, 1.25, 0.05 / 3)
    rng = np.random.default_rng(0)
    trials = rng.normal(0.005, 0.004, size=(4000, n))
    found = (scipy_stats.ttest_1samp(trials, 0.0, axis=1).pvalue <= 0.05 / 3).mean()
    assert found == pytest.approx(t_power(n, 1.25, 0.05 / 3), abs=0.025)
    assert seeds_needed(0.0, 0.005, 0.05) == 2 and seeds_needed(float("nan"), 0.005, 0.05) is None
    # normal approximation: ((1.960 + 0.842) / 0.005)^2 = 313,956; beyond a million seeds: None
    assert seeds_needed(1.0, 0.005, 0.05) == 313957 and seeds_needed(4.0, 0.005, 0.05) is None


def federation_runs(rng, effects: np.ndarray, seeds: int, seed_sd: float, noise_sd: float):
    """One federation (clients with their own true effect) run on `seeds` seeds: per seed the baseline's and the
    pipeline's per-client values, [seeds, clients] each, and the paired differences of their means."""
    base = rng.uniform(0.5, 0.9, len(effects))
    theirs = base + rng.normal(0, noise_sd, (seeds, len(effects)))
    ours = base + effects + rng.normal(0, seed_sd, (seeds, 1)) + rng.normal(0, noise_sd, (seeds, len(effects)))
    return ours, theirs, (ours - theirs).mean(axis=1)


def coverage(seeds: int, tau: float, seed_sd: float, noise_sd: float, population: bool,
             repeats: int = 200) -> tuple[float, float]:
    """How often the 95% t interval and the crossed bootstrap contain the true difference (0.02 on average over the
    clients' population; with `population` False, the federation's own mean effect) over `repeats` federations."""
    rng = np.random.default_rng(7)
    hits = np.zeros(2)
    for repeat in range(repeats):
        effects = rng.normal(0.02, tau, 30)
        truth = 0.02 if population else effects.mean()
        ours, theirs, diffs = federation_runs(rng, effects, seeds, seed_sd, noise_sd)
        for i, interval in enumerate((t_interval(diffs),
                                      bootstrap_interval(crossed_draws(ours, theirs, mean_of, 999, repeat)))):
            hits[i] += interval.low <= truth <= interval.high
    return hits[0] / repeats, hits[1] / repeats


def test_the_hierarchical_bootstrap_recovers_a_known_difference():
    """Federations of 30 clients whose effects spread around 0.02, 4 seeds, per-client noise: the crossed bootstrap
    covers 0.02 in about 95% of 200 federations (measured 0.950); the t over seeds, blind to the clients, less
    (0.755)."""
    t_hits, boot_hits = coverage(seeds=4, tau=0.03, seed_sd=0.002, noise_sd=0.02, population=True)
    assert 0.9 <= boot_hits <= 0.99 and t_hits < boot_hits


def test_each_interval_covers_what_the_other_misses():
    """Why a verdict needs both (stats.verdicts): with 3 seeds and the seeds' noise dominating, the bootstrap cannot
    reach past the 3 seeds it saw (measured coverage 0.785 of 0.95) while the t holds (0.960); with the clients' own
    effects dominating, the t over seeds covers this federation, not other clients like them (0.130), the bootstrap
    does (0.915)."""
    t_hits, boot_hits = coverage(seeds=3, tau=0.0, seed_sd=0.01, noise_sd=0.005, population=False)
    assert t_hits >= 0.9 and boot_hits <= 0.85
    t_hits, boot_hits = coverage(seeds=5, tau=0.05, seed_sd=0.001, noise_sd=0.005, population=True)
    assert t_hits <= 0.3 and boot_hits >= 0.85


def test_the_bootstrap_widens_with_client_noise_and_resamples_a_shared_federation_once():
    rng = np.random.default_rng(1)
    widths = []
    for tau in (0.0, 0.02, 0.08):
        noise = np.random.default_rng(2)  # the same seeds' noise: only the clients' spread changes
        effects = 0.02 + tau * rng.standard_normal(40)
        ours, theirs, _ = federation_runs(noise, effects, 4, 0.002, 0.01)
        interval = bootstrap_interval(crossed_draws(ours, theirs, mean_of, 1999))
        widths.append(interval.high - interval.low)
    assert widths[0] < widths[1] < widths[2]
    # the same clients on every seed: resampling them afresh per seed (nested) counts each client seeds-many
    # times over and narrows the interval by about sqrt(seeds)
    pairs = list(zip(ours, theirs, strict=True))
    nested = bootstrap_interval(nested_draws(pairs, mean_of, 1999))
    assert nested.high - nested.low < 0.7 * widths[2]


def scores_and_values(shifts: dict[str, float], seeds: int = 4, clients: int = 30, seed: int = 0):
    """Synthetic comparison outcomes on one federation: per pipeline, seed and client a value, the pipeline's shift
    plus noise; the scores their mean and p10 per seed."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.5, 0.9, clients)
    values = {p: {s: {f"c{c}": float(base[c] + shift + rng.normal(0, 0.01)) for c in range(clients)}
                  for s in range(seeds)} for p, shift in shifts.items()}
    scores = {p: {s: {"test_acc_mean": float(np.mean(list(v.values()))),
                      "test_acc_p10": float(np.percentile(list(v.values()), 10))} for s, v in by_seed.items()}
              for p, by_seed in values.items()}
    return scores, values


def test_verdicts_resolve_what_holm_rejects_on_both_intervals():
    scores, values = scores_and_values({"base": 0.0, "big": 0.05, "none": 0.0, "small": 0.004})
    found = verdicts(scores, values, "base", "acc", crossed=True)
    assert set(found) == {"test_acc_mean", "test_acc_p10"} and set(found["test_acc_mean"]) == {"big", "none", "small"}
    rows = found["test_acc_mean"]
    assert rows["big"]["resolved"] and not rows["none"]["resolved"]
    p = [rows[n]["p"] for n in rows]
    assert [rows[n]["p_holm"] for n in rows] == pytest.approx(holm(p))
    assert [rows[n]["level"] for n in rows] == pytest.approx(holm_levels(p))
    for row in rows.values():
        assert row["p"] == max(row["p_t"], row["p_boot"]) and row["seeds"] == 4 and row["clients"] == 30
        low, high = hull(row)
        assert row["resolved"] == (low > 0 or high < 0)
        assert row["t_holm_low"] <= row["t_low"] and row["t_holm_high"] >= row["t_high"]  # adjusted: wider
        assert row["seeds_needed"] == seeds_needed(row["diff_sd"], 0.005, 0.05 / 3)
    diffs = np.array([scores["big"][s]["test_acc_mean"] - scores["base"][s]["test_acc_mean"] for s in range(4)])
    assert rows["big"]["diff_mean"] == pytest.approx(diffs.mean())
    assert (rows["big"]["t_holm_low"], rows["big"]["t_holm_high"]) == pytest.approx(
        tuple(t_interval(diffs, rows["big"]["level"]).__dict__.values()))


def test_one_seed_resolves_nothing_and_missing_clients_leave_the_t_alone():
    scores, values = scores_and_values({"base": 0.0, "big": 0.05}, seeds=1)
    row = verdicts(scores, values, "base", "acc", crossed=True)["test_acc_mean"]["big"]
    assert not row["resolved"] and math.isnan(row["p"]) and row["seeds_needed"] is None
    scores, values = scores_and_values({"base": 0.0, "big": 0.05}, seeds=3)
    row = verdicts(scores, {}, "base", "acc", crossed=False)["test_acc_mean"]["big"]
    assert math.isnan(row["p_boot"]) and row["p"] == row["p_t"] and row["clients"] == 0
    assert row["resolved"] == (row["p_holm"] <= 0.05)
    mse = verdicts(scores, values, "base", "mse", crossed=True)  # scores named by the metric: none here
    assert mse == {"test_mse_mean": {}, "test_mse_p10": {}}


def test_the_table_shows_each_difference_with_its_adjusted_interval_in_points():
    scores, values = scores_and_values({"base": 0.0, "big": 0.05, "none": 0.0})
    found = verdicts(scores, values, "base", "acc", crossed=True)
    rows = pipelines_rows(summarize(scores, "base"), "base", "acc", verdicts=found)
    assert rows[1][2] == ""  # the baseline has no difference with itself
    big = found["test_acc_mean"]["big"]
    low, high = hull(big)
    assert rows[2][2] == f"+{100 * big['diff_mean']:.2f} [{100 * low:+.2f}, {100 * high:+.2f}] pp resolved"
    assert not rows[3][2].endswith("resolved")
    text = format_verdicts(found, "base", "acc", sample_steps([100, 300, 200], "acc")).replace("\n", " ")
    assert "adjusted by Holm's step-down for the 2 comparison(s) with base" in text
    assert "one test sample moves a client's accuracy by 0.0050 (median client) and test_acc_mean by 0.0017" in text
    assert "seeds for 0.50 pp" in text and "test_acc_p10 against base" in text
    assert math.isnan(sample_steps([100, 0], "acc")["client"]) and math.isnan(sample_steps([5], "mse")["mean"])
    assert "base.test_acc_mean.diff_mean" not in {f"{n}.{k}" for n, r in summarize(scores, "base").items() for k in r}


def test_the_winners_curse_is_the_best_minus_its_reruns_the_way_that_is_better():
    gap = optimism(0.90, [0.85, 0.87, 0.86], maximize=True)
    assert gap["optimism"] == pytest.approx(0.04) and gap["comparison"] == pytest.approx(0.86)
    assert (gap["low"], gap["high"]) == pytest.approx(tuple(t_interval(np.array([0.05, 0.03, 0.04])).__dict__.values()))
    assert optimism(0.30, [0.35, 0.33], maximize=False)["optimism"] == pytest.approx(0.04)  # a loss: lower is better
    assert math.isnan(optimism(float("nan"), [0.8, 0.9], maximize=True)["optimism"])


def test_searched_keys_read_as_stage_and_whole_key_and_never_collide():
    stages = ["pretrain", "personalize", "finetune"]
    keys = ["stages.1.local.lr", "stages.1.server.lr", "stages.2.params.lam", "model.width", "stages.7.local.lr"]
    assert key_labels(keys, stages) == {"stages.1.local.lr": "personalize.local.lr",
                                        "stages.1.server.lr": "personalize.server.lr",
                                        "stages.2.params.lam": "finetune.params.lam", "model.width": "model.width",
                                        "stages.7.local.lr": "stages.7.local.lr"}  # an index without a name: whole
    odd = ["a.local", "a"]  # stage names that make two labels read "a.local.lr": both keep their whole key
    assert key_labels(["stages.0.lr", "stages.1.local.lr"], odd) == {"stages.0.lr": "stages.0.lr",
                                                                     "stages.1.local.lr": "stages.1.local.lr"}
    study = study_summary("s", [(0.8, {"stages.1.local.lr": 0.1, "stages.1.server.lr": 0.5})], True, stages)
    assert tuning_rows({"p": study}, "val_acc_mean")[1][-1] == "personalize.local.lr=0.1, personalize.server.lr=0.5"
