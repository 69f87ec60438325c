# frozen_string_literal: true

# Enqueues jobs with real Resque (and resque-scheduler, ActiveJob) through locketd's Ruby shim
# (clients/ruby/locketd_resque.rb). resque's lib dir (and resque-scheduler's) come on the load
# path from the caller (-I).
#
# ARGV[0]: {"port": P, "namespace": "resque", "scheduler": bool,
#           "jobs": [{"via": "enqueue" | "enqueue_at" | "remove_delayed" | "perform_later",
#                     "queue": "q", "class": "Job", "args": [1], "at": <unix secs>}]}
# Each job's class is defined with `@queue` = its queue and after_enqueue / after_schedule
# hooks that record their calls. Prints, as its last line,
# {"ok":true,"results":[each call's return value],"hooks":[[hook, class, args], ...]}.

require "json"
require "resque"
config = JSON.parse(ARGV.fetch(0))
require "resque-scheduler" if config["scheduler"]
require_relative "../../clients/ruby/locketd_resque"

HOOKS = []

def job_class(name, queue)
  *outer, last = name.split("::")
  mod = outer.reduce(Object) do |m, part|
    m.const_defined?(part, false) ? m.const_get(part, false) : m.const_set(part, Module.new)
  end
  klass = mod.const_defined?(last, false) ? mod.const_get(last, false) : mod.const_set(last, Class.new)
  klass.instance_variable_set(:@queue, queue)
  klass.define_singleton_method(:after_enqueue_record) { |*args| HOOKS << ["after_enqueue", name, args] }
  klass.define_singleton_method(:after_schedule_record) { |*args| HOOKS << ["after_schedule", name, args] }
  klass
end

Resque.redis = Redis::Namespace.new(config.fetch("namespace"),
                                    redis: Redis.new(host: "127.0.0.1", port: config.fetch("port")))

active_job = nil
results = config.fetch("jobs").map do |job|
  args = job["args"] || []
  case job.fetch("via")
  when "enqueue"
    Resque.enqueue(job_class(job["class"], job["queue"]), *args)
  when "enqueue_at"
    Resque.enqueue_at(Time.at(job.fetch("at")), job_class(job["class"], job["queue"]), *args)
  when "remove_delayed"
    Resque.remove_delayed(job_class(job["class"], job["queue"]), *args)
  when "perform_later"
    unless active_job
      # ActiveJob 6.1 ships its own Resque adapter; resque's copy (for Rails 7.2 and later)
      # would shadow it: resque's lib dir goes to the end of the load path.
      $LOAD_PATH.push($LOAD_PATH.delete($LOAD_PATH.find { |d| File.file?(File.join(d, "resque.rb")) }))
      require "active_job"
      ActiveJob::Base.queue_adapter = :resque
      ActiveJob::Base.logger = Logger.new(nil)
      active_job = Class.new(ActiveJob::Base) { def perform(*); end }
      Object.const_set(:LocketdTestJob, active_job)
    end
    active_job.set(queue: job["queue"]).perform_later(*args) ? true : false
  else
    raise ArgumentError, "unknown via #{job['via']}"
  end
end
puts JSON.generate({ "ok" => true, "results" => results, "hooks" => HOOKS })
