# frozen_string_literal: true

# ruby bench/sidekiq/enqueue.rb REDIS_URL N: flushes that database (a private
# redis-server the harness started), pushes N NoopJob jobs with push_bulk, 1,000
# per call, and prints the length of queue:default.
require "sidekiq"
require_relative "job"

url, n = ARGV[0], ARGV[1].to_i
Sidekiq.configure_client { |c| c.redis = { url: url } }
Sidekiq.redis(&:flushdb)
(0...n).each_slice(1000) do |slice|
  Sidekiq::Client.push_bulk("class" => NoopJob, "args" => slice.map { |i| [i] })
end
puts Sidekiq.redis { |r| r.llen("queue:default") }
