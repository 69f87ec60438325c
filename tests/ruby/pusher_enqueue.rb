# frozen_string_literal: true

# Enqueues jobs through locketd's Ruby shim without Resque: Locketd::Pusher on a redis-rb
# client (clients/ruby/locketd_resque.rb), the payload written as Resque writes it. When no
# daemon has published PUSH (the pusher returns nil), the job is pushed as Resque pushes it.
#
# ARGV[0]: {"port": P, "namespace": "resque",
#           "jobs": [{"queue": "q", "class": "Job", "args": [1], "at": <unix secs, optional>}]}
# Prints {"ok":true,"pushed":[true|false, ...],"warnings":[...]} as its last line.

require "json"
require "redis"
require_relative "../../clients/ruby/locketd_resque"

config = JSON.parse(ARGV.fetch(0))
ns = config.fetch("namespace")
redis = Redis.new(host: "127.0.0.1", port: config.fetch("port"))
warnings = []
pusher = Locketd::Pusher.new(redis, ns, warn: ->(m) { warnings << m })
pushed = config.fetch("jobs").map do |job|
  queue = job.fetch("queue")
  if job["at"]
    item = JSON.generate({ "class" => job["class"], "args" => job["args"], "queue" => queue })
    done = pusher.push_at(queue, item, job["at"])
    if done.nil?
      ts = job["at"].to_i
      redis.rpush("#{ns}:delayed:#{ts}", item)
      redis.call("SADD", "#{ns}:timestamps:#{item}", "delayed:#{ts}")
      redis.zadd("#{ns}:delayed_queue_schedule", ts, ts)
      done = true
    end
  else
    payload = JSON.generate({ "class" => job["class"], "args" => job["args"] })
    done = pusher.push(queue, payload)
    if done.nil?
      redis.call("SADD", "#{ns}:queues", queue)
      redis.rpush("#{ns}:queue:#{queue}", payload)
      done = true
    end
  end
  done
end
puts JSON.generate({ "ok" => true, "pushed" => pushed, "warnings" => warnings })
