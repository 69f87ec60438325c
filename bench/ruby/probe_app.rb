# frozen_string_literal: true

# APP_FILE for `locketd-bench handler-latency`: the example app (its `Noop` class
# and the rest) plus `Probe`, which prints its enqueue-to-start latency the way
# locketd's `probe` builtin logs it. The harness reads `latency_us=N` from the
# handler's stdout, which locketd logs at info with target locketd::handler.
require_relative "../../examples/ruby-app/app"

# args[0] is {"enqueued_at_us" => T}, T in Unix microseconds, written by the harness.
class Probe
  @queue = :bench

  def self.perform(marker = nil, *_rest)
    t0 = marker.is_a?(Hash) ? marker["enqueued_at_us"] : nil
    return unless t0

    now = Process.clock_gettime(Process::CLOCK_REALTIME, :microsecond)
    $stdout.puts("latency_us=#{[now - t0.to_i, 0].max}")
  end
end
