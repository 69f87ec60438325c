# frozen_string_literal: true

# ruby bench/sidekiq/enqueue.rb REDIS_URL N [CLASS]: flushes that database (a
# private redis-server the harness started), pushes N jobs of CLASS (default
# NoopJob) with push_bulk, 1,000 per call, each with args [i], and prints the
# length of queue:default. CLASS is pushed by name: this process need not load it.
require "sidekiq"
require_relative "job"

url, n, klass = ARGV[0], ARGV[1].to_i, ARGV[2] || "NoopJob"
Sidekiq.configure_client { |c| c.redis = { url: url } }
Sidekiq.redis(&:flushdb)
(0...n).each_slice(1000) do |slice|
  Sidekiq::Client.push_bulk("class" => klass, "args" => slice.map { |i| [i] })
end
puts Sidekiq.redis { |r| r.llen("queue:default") }
