"""`ctxmix.engine.timing.Stopwatch`: perf_counter spans on a CPU; on CUDA, pairs of CUDA events read
once, after one synchronisation (a fake CUDA here: events stamped by a fake clock, synchronisations
counted), so a per-layer loop timed with it never waits for the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

from ctxmix.engine import timing
from ctxmix.engine.timing import Stopwatch


class FakeClock:
    """Hands out 1.0, 2.5, 4.5, 7.0, ... (each step 0.5 s longer than the last): spans differ."""

    def __init__(self):
        self.t, self.step = 1.0, 1.5

    def __call__(self) -> float:
        t = self.t
        self.t += self.step
        self.step += 0.5
        return t


def test_cpu_spans_are_perf_counter_seconds(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    sw = Stopwatch("cpu")
    t = sw.mark()  # 1.0
    sw.add(t, "a", "b")  # 2.5: 1.5 to a and b
    with sw.time("a"):  # 4.5 .. 7.0: 2.5 more to a
        pass
    assert sw.seconds() == {"a": 4.0, "b": 1.5}
    real = Stopwatch("cpu")
    with real.time("x"):
        torch.zeros(1000).sum()
    assert real.seconds()["x"] >= 0


class FakeCuda:
    """torch.cuda's Event and synchronize: an event records the fake clock's time; elapsed_time (ms)
    refuses to answer before a synchronisation, as a CUDA event not yet reached would."""

    def __init__(self):
        self.clock, self.syncs, self.events = FakeClock(), 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self, stream=None):
                fake.events += 1
                self.t = fake.clock()
                self.synced = False

            def elapsed_time(self, end):
                assert fake.syncs > 0, "read before a synchronisation"
                return (end.t - self.t) * 1000.0

        self.Event = Event

    def synchronize(self, device=None):
        self.syncs += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def test_cuda_spans_are_event_pairs_read_after_one_synchronisation(fake_cuda):
    sw = Stopwatch("cuda")
    for _ in range(5):  # a per-layer loop: events only, no synchronisation
        with sw.time("layer", "all"):
            pass
    assert fake_cuda.syncs == 0 and fake_cuda.events == 10
    # spans: (1.0, 2.5), (4.5, 7.0), (10.0, 13.5), (17.5, 22.0), (27.0, 32.5)
    want = 1.5 + 2.5 + 3.5 + 4.5 + 5.5
    got = sw.seconds()
    assert fake_cuda.syncs == 1
    assert got["layer"] == pytest.approx(want, rel=1e-12) and got["all"] == got["layer"]


def test_one_pass_costs_wait_for_the_gpu_once_per_reading_not_per_layer(tokenizer, monkeypatch, fake_cuda):
    """run_one_pass charges each method the trace, the layer rebuilds and its own layer work; timed on a
    (fake) GPU, the whole call synchronises twice (decompose_rows' reading and the trace's), whatever
    the number of layers, and each method's seconds are its spans' event differences."""
    from ctxmix.methods.context import onepass

    class GpuStopwatch(Stopwatch):  # the CUDA branch on this CPU's tensors
        def __init__(self, device):
            super().__init__("cuda")

    monkeypatch.setattr(onepass, "Stopwatch", GpuStopwatch)
    m = tiny_model("llama", tokenizer)
    ids = tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"]
    P = 5
    out = onepass.run_one_pass(m, ["logit", "alti_logit", "attention"], ids, P, "log_prob", streamed=True)
    assert fake_cuda.syncs == 2
    # marks: the trace (2), the readout (2), per layer: the rebuild, logit, alti_logit, attention (8)
    assert fake_cuda.events == 2 + 2 + 8 * m.n_layers
    secs = {k: out[k]["cost"]["seconds"] for k in out}
    # every span is longer than the one before (the fake clock), and alti_logit's own spans include
    # the logit span and its own: the ordering is the arithmetic's, not this machine's speed
    assert secs["alti_logit"] > secs["logit"] > 0 and secs["attention"] > 0
    assert all(np.isfinite(v) for v in secs.values())
