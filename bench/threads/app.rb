# frozen_string_literal: true

# The app of `locketd-bench threads` (issue 38), loaded by both systems: by
# adapters/ruby/locketd-ruby as its APP_FILE, and by Sidekiq through
# sidekiq_app.rb. It stands in for a Rails app's loaded code: ActiveSupport
# (all of it) and ActiveJob, plus about 60 MB of retained heap made of many
# small live objects (records with strings, arrays and hashes), as a booted
# app's caches and loaded code are. Its one job, `Sleep`, waits 50 ms, as a job
# that waits on a remote API does.
require "json"
require "active_support/all"
require "active_job"

# About 60 MB of live objects (RETAINED_MB, default 60), kept for the life of
# the process so every GC marks them.
module BenchApp
  RECORD_BYTES = 490 # what one record below costs in RSS, measured with Ruby 3.1

  def self.retain(megabytes)
    count = megabytes * 1024 * 1024 / RECORD_BYTES
    Array.new(count) do |i|
      { id: i, name: "record-#{i}-#{'x' * 24}", tags: ["t#{i % 97}", "u#{i}"] }
    end
  end

  RETAINED = retain(Integer(ENV.fetch("RETAINED_MB", "60")))
end

# Resque-style class for locketd: sleeps 50 ms (SLEEP_MS overrides).
class Sleep
  @queue = :bench
  SECONDS = Integer(ENV.fetch("SLEEP_MS", "50")) / 1000.0

  def self.perform(*_args)
    sleep(SECONDS)
  end
end
