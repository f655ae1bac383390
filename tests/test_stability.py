"""The stability guard's detector and decisions (clusterops.supervisor.stability), pure.

Property tests: generated healthy loss curves (noisy, with an LR warm-up and schedule bumps)
give no finding; generated spikes and NaNs are found within the configured delay."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings, strategies as st

from clusterops.supervisor import stability as stb
from clusterops.supervisor.stability import Kind, Sample, StabilityConfig

CFG = StabilityConfig(warmup_steps=50, min_samples=8, window=64, factor=6.0, patience=2)


def healthy_curve(seed: int, n: int, noise: float, bumps: int, warmup: int, stride: int):
    """(step, loss) samples: an LR warm-up (slow start), exponential decay to a floor,
    multiplicative Gaussian noise, and schedule bumps (gradual rises of up to 10%)."""
    rng = random.Random(seed)
    tau = rng.uniform(200, 3000)
    floor, top = rng.uniform(0.5, 2.0), rng.uniform(3.0, 11.0)
    bump_at = [rng.randrange(0, 200) + 600 * k for k in range(bumps)]   # one at a time, apart
    out, step = [], 0
    for _ in range(n):
        step += rng.randint(1, stride)
        ramp = min(1.0, step / max(warmup, 1))          # a learning rate still warming up learns slowly
        base = floor + (top - floor) * math.exp(-ramp * step / tau)
        for b in bump_at:                                # a restart of the schedule: up by <= 10%, gradually
            if step > b:
                base *= 1 + 0.10 * min(1.0, (step - b) / 40.0) * math.exp(-(step - b) / 400.0)
        out.append((step, base * (1 + rng.gauss(0, noise))))
    return out


def feed_all(det, samples):
    return [f for f in (det.feed(Sample(s, v)) for s, v in samples) if f is not None]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(20, 250), noise=st.floats(0.0, 0.02),
       bumps=st.integers(0, 3), warmup=st.integers(0, 500), stride=st.integers(1, 20))
def test_healthy_curves_give_no_finding(seed, n, noise, bumps, warmup, stride):
    det = stb.Detector(CFG)
    assert feed_all(det, healthy_curve(seed, n, noise, bumps, warmup, stride)) == []


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), noise=st.floats(0.0, 0.02), stride=st.integers(1, 20),
       at=st.integers(60, 150), factor=st.floats(3.0, 1000.0), length=st.integers(2, 50))
def test_spikes_are_found_within_patience(seed, noise, stride, at, factor, length):
    curve = healthy_curve(seed, 200, noise, 0, 100, stride)
    start = curve[at][0]
    spiked = [(s, v * factor if at <= i < at + length else v) for i, (s, v) in enumerate(curve)]
    found = feed_all(stb.Detector(CFG), spiked)
    assert found, "a spike was not found"
    f = found[0]
    assert f.kind == Kind.SPIKE
    # Found at the patience-th spiked sample, and it says the anomaly began no later than the
    # spike did (after the last sample in the band).
    assert f.step == curve[at + CFG.patience - 1][0]
    assert curve[at - 1][0] < f.began <= start


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), stride=st.integers(1, 20), at=st.integers(0, 120),
       bad=st.sampled_from([math.nan, math.inf, -math.inf]), signal=st.sampled_from(["loss", "grad_norm"]))
def test_non_finite_is_found_at_once_even_in_warmup(seed, stride, at, bad, signal):
    curve = healthy_curve(seed, 130, 0.01, 0, 100, stride)
    det = stb.Detector(CFG)
    for i, (s, v) in enumerate(curve):
        value = bad if i == at else v
        sample = Sample(s, value, 1.0) if signal == "loss" else Sample(s, v, value)
        f = det.feed(sample)
        if i < at:
            assert f is None
        elif i == at:
            assert f is not None and f.kind == Kind.NAN and f.signal == signal and f.step == s
            break


def test_a_spike_that_turns_nan_began_at_the_spike():
    curve = [(s, 2.0 + 0.001 * (s % 3)) for s in range(1, 200)]
    det = stb.Detector(StabilityConfig(warmup_steps=10, patience=5))
    for s, v in curve[:150]:
        assert det.feed(Sample(s, v)) is None
    assert det.feed(Sample(151, 40.0)) is None          # out of the band, patience not reached
    f = det.feed(Sample(152, math.nan))
    assert f.kind == Kind.NAN and f.began == 151


def test_after_a_resume_the_old_band_judges_the_new_attempt():
    det = stb.Detector(StabilityConfig(warmup_steps=10, resume_grace_steps=5, patience=1))
    for s in range(1, 101):
        det.feed(Sample(s, 1.0 + 0.001 * (s % 5)))
    det.resumed(60)                       # samples after step 60 are of the discarded timeline
    assert all(s <= 60 for s, _ in det.bands["loss"].values)
    assert det.feed(Sample(63, 50.0)) is None            # within the grace steps: not judged
    assert det.feed(Sample(66, 50.0)).kind == Kind.SPIKE  # judged by the band from before


def test_sample_of_ranks_median_and_non_finite_ranks():
    s = stb.sample_of({0: (10, 1.0, None), 1: (9, 3.0, 2.0), 2: (10, 2.0, None)})
    assert (s.step, s.loss, s.grad_norm, s.nonfinite) == (9, 2.0, 2.0, ())
    s = stb.sample_of({0: (10, 1.0, 1.0), 3: (10, math.nan, 1.0)})
    assert math.isnan(s.loss) and s.nonfinite == (3,)
    assert stb.sample_of({}) is None
    # A node's beat that lags (a loaded machine) does not pull a NaN back to its older step:
    # the NaN was seen at step 76, where the rank that carries it beat.
    s = stb.sample_of({0: (73, 2.0, None), 1: (76, math.nan, None), 2: (76, 2.1, None)})
    assert s.step == 76 and math.isnan(s.loss) and s.nonfinite == (1,)
    s = stb.sample_of({0: (73, 2.0, None), 1: (76, math.nan, None), 2: (75, math.inf, None)})
    assert s.step == 75 and s.nonfinite == (1, 2)


def test_the_skip_passes_the_anomaly_whatever_the_sampling():
    # Samples 16 steps apart (a loaded machine): the last good one at 47, a NaN at 64 from
    # batches poisoned from 60. The onset can only be placed at 48: back to 30 (at or before
    # 38), and a skip of 30 would end at 59, into the poison. It ends 20 past step 64.
    g = stb.Guard(StabilityConfig(warmup_steps=0, min_samples=3, patience=1, on_nan="rollback", rollback_steps=10,
                                  skip_batches=30, lr_factor=0.5, max_rollbacks=2, rollback_window_steps=1000))
    for s in (10, 20, 30, 40, 50, 60):
        g.checkpoint(s)
    g.launched(None)
    for s in range(15, 48, 16):
        assert g.feed({0: (s, 1.0, None)}) is None
    d = g.feed({0: (64, math.nan, None)})
    assert (d.finding.began, d.hint.from_step, d.hint.skip_batches) == (48, 30, 54)
    # Dense samples and a checkpoint right at rollback_steps before: the skip as set.
    g = stb.Guard(StabilityConfig(warmup_steps=0, min_samples=3, patience=1, on_nan="rollback", rollback_steps=10,
                                  skip_batches=30, lr_factor=0.5, max_rollbacks=2, rollback_window_steps=1000))
    for s in (10, 20, 30, 40, 50, 60):
        g.checkpoint(s)
    g.launched(None)
    for s in range(1, 60):
        assert g.feed({0: (s, 1.0, None)}) is None
    d = g.feed({0: (60, math.nan, None)})
    assert (d.finding.began, d.hint.from_step, d.hint.skip_batches) == (60, 50, 30)


def _guard(**kw):
    g = stb.Guard(StabilityConfig(**dict(dict(warmup_steps=0, min_samples=3, patience=1, on_spike="rollback",
                                              rollback_steps=20, skip_batches=30, lr_factor=0.5,
                                              max_rollbacks=2, rollback_window_steps=1000), **kw)))
    for s in (20, 40, 60, 80):
        g.checkpoint(s)
    return g


def test_rollback_goes_to_the_newest_checkpoint_rollback_steps_before_the_anomaly():
    g = _guard()
    g.launched(None)
    for s in range(1, 71):
        assert g.feed({0: (s, 1.0, None)}) is None
    d = g.feed({0: (75, math.nan, None)})
    assert d.action == stb.Action.ROLLBACK
    # began 71 -> at or before 51 -> checkpoint 40; checkpoints after it are forgotten. A skip
    # of 30 would end at step 69, before the anomaly: it reaches 10 (skip 30 - rollback 20)
    # past step 75, the NaN seen: 45 batches
    assert d.hint == stb.ResumeHint(from_step=40, skip_batches=45, lr_factor=0.5, anomaly_step=71, rollback=1)
    assert g.ckpt_steps == [20, 40]
    assert stb.ResumeHint.from_json(d.hint.to_json()) == d.hint
    g.checkpoint(40)
    assert g.hint is not None             # the same checkpoint again: the hint stands
    g.checkpoint(60)
    assert g.hint is None                 # saved past the skip: the next resume needs no hint


def test_repeated_anomalies_give_up_after_max_rollbacks():
    g = _guard()
    decisions = []
    for _ in range(3):
        g.launched(40)
        decisions.append(g.feed({0: (45, math.inf, None)}).action)
    assert decisions == ["rollback", "rollback", "give_up"]


def test_record_and_stop_change_nothing_in_the_guard():
    for action in ("record", "stop"):
        g = _guard(on_nan=action)
        g.launched(None)
        d = g.feed({0: (5, math.nan, None)})
        assert d.action == action and d.hint is None and g.rollbacks == [] and g.ckpt_steps == [20, 40, 60, 80]


def test_no_checkpoint_early_enough_gives_up():
    g = _guard()
    g.launched(None)
    assert g.feed({0: (30, math.nan, None)}).action == stb.Decision.GIVE_UP


def test_bad_hints_read_as_none():
    for text in ("", "nope", "[]", '{"skip_batches": 3}', '{"from_step": "x"}'):
        assert stb.ResumeHint.from_json(text) is None
