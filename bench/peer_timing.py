"""What the same-run peer benchmarks share (prefill_peer.py, decode_peer.py): interleaved timing
with the L2 flushed before each call, sustained timing (calls back to back under the board's power
limit), a sampler of the GPU's clock and power, normal data."""

import statistics
import subprocess
import threading
import time

import torch


class GpuSampler:
    """nvidia-smi's SM clock, power and throttle reasons, queried repeatedly while a case runs.
    `instant`: the board's instantaneous power (power.draw.instant) instead of its one-second
    average, for windows of a second or less.

    Most samples fall between the timed kernels (the L2 flush, the host's work), so they show the
    board's state, not the clock inside a kernel: clock64 against %globaltimer in the decode
    kernels read 1640-1790 MHz while these samples read 1980 (bench/RESULTS.md, twenty-seventh
    session). The summary gives the median and the lowest clock seen, and every throttle reason."""

    def __init__(self, instant=False):
        power = "power.draw.instant" if instant else "power.draw"
        self.query = ["nvidia-smi", f"--query-gpu=clocks.sm,{power},clocks_throttle_reasons.active",
                      "--format=csv,noheader,nounits"]
        self.samples, self._stop, self._thread = [], threading.Event(), None

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            try:
                line = subprocess.run(self.query, capture_output=True, text=True, timeout=5).stdout
                clock, power, reasons = (x.strip() for x in line.strip().split(","))
                self.samples.append((float(clock), float(power), reasons))
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi, or an answer we cannot read: stop asking
            self._stop.wait(0.05)

    def medians(self):
        """(median SM clock in MHz, median power in W), or None without samples."""
        if not self.samples:
            return None
        return (statistics.median(c for c, _, _ in self.samples), statistics.median(p for _, p, _ in self.samples))

    def summary(self):
        if not self.samples:
            return "clock/power n/a"
        reasons = sorted({r for _, _, r in self.samples})
        clock, power = self.medians()
        return (f"SM {clock:.0f} MHz (min {min(c for c, _, _ in self.samples):.0f}), "
                f"{power:.0f} W, throttle {'/'.join(reasons)}")


class Timer:
    """Median GPU time of callables, interleaved, each after an L2 flush.

    The flush (a 256 MB write; the H200's L2 holds 60 MB) is queued behind a short sleep kernel so
    that the GPU is still busy with it while Python queues the start event and the call: the
    events then time the call, not the launch overhead of the Python layers."""

    def __init__(self):
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once(self, fn, i=0):
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU time
        self.flush.fill_(i & 0xFF)
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)

    def sustained(self, fn, seconds):
        """(median ms of a call, GpuSampler of the timed window): `fn` called back to back, each
        call after an L2 flush and timed by its own pair of events, with no synchronisation in
        between, so that the GPU never idles, as in a server running layer after layer. A warm-up of
        a quarter of `seconds` (untimed) first brings the board to its steady clock and power."""
        def run(window):
            pairs, begin = [], time.monotonic()
            while time.monotonic() - begin < window:
                self.flush.fill_(len(pairs) & 0xFF)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
                if len(pairs) % 64 == 0:
                    pairs[-32][1].synchronize()  # the host stays at most ~32 calls ahead
            pairs[-1][1].synchronize()
            return pairs
        run(seconds / 4)
        with GpuSampler(instant=True) as sampler:
            pairs = run(seconds)
        return statistics.median(s.elapsed_time(e) for s, e in pairs), sampler

    def interleaved(self, fns, iters, warmup=3):
        """{name: fn} -> {name: median ms, or the exception a call raised}."""
        results, live = {}, dict(fns)
        for name, fn in list(live.items()):
            try:
                for i in range(warmup):
                    self.once(fn, i)
            except Exception as error:  # a refused or unsupported call: reported, not fatal
                results[name] = error
                del live[name]
        times = {name: [] for name in live}
        for i in range(iters):
            for name, fn in live.items():
                times[name].append(self.once(fn, i))
        results.update({name: statistics.median(t) for name, t in times.items()})
        return results


def normal(shape, dtype, generator):
    return torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)
