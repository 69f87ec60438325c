"""MODULE for adapters/python/locketd_handler.py in `locketd-bench`: `Noop` for the
drains and `Probe`, which prints its enqueue-to-start latency the way locketd's
`probe` builtin logs it. The harness reads `latency_us=N` from the handler's
stdout, which locketd logs at info with target locketd::handler."""

import time


class Noop:
    """Does nothing: for throughput benchmarks."""

    @staticmethod
    def perform(*args):
        pass


class Probe:
    """args[0] is {"enqueued_at_us": T}, T in Unix microseconds, written by the harness."""

    @staticmethod
    def perform(marker=None, *rest):
        if not isinstance(marker, dict) or "enqueued_at_us" not in marker:
            return
        now = time.time_ns() // 1000
        print(f"latency_us={max(now - int(marker['enqueued_at_us']), 0)}")
