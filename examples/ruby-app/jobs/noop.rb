# frozen_string_literal: true

# Does nothing: for throughput benchmarks.
class Noop
  @queue = :default

  def self.perform(*_args); end
end
