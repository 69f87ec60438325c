# frozen_string_literal: true

# locketd's PUSH for Resque (locking-semantics.md D-3a, D-3b). Copy this file into your app
# (it needs only resque and redis) and require it after resque (and resque-scheduler, if you
# use it):
#
#   require "resque"
#   require "resque-scheduler"          # optional
#   require_relative "locketd_resque"
#
#   Resque.enqueue(Webhook::Receive, 42)       # => false for a duplicate `unique` refused
#   Resque.enqueue_in(300, Webhook::Receive, 43)
#
# Every push of Resque (`Resque.push`, which `Resque.enqueue`, `enqueue_to`, `Resque::Job.create`
# and ActiveJob's Resque adapter reach) goes through PUSH: the enqueue-time holds of the job's
# class are placed and its `unique` rule applied in the same step as the push; a class whose
# published plan does neither is pushed as Resque pushes it (PUSH does that itself). With
# resque-scheduler, `enqueue_at`, `enqueue_in` and `enqueue_at_with_queue` schedule through
# PUSH_AT, PUSH's delayed form: the holds are placed when the job is scheduled, and the item is
# the gem's own bytes, so `remove_delayed` and the gem's scheduler see it as before.
#
# `enqueue`, `enqueue_to` and `enqueue_at*` return false for a duplicate, and its
# after_enqueue (after_schedule) hooks do not run; `Resque.push` and `Job.create` called
# directly return false. (`enqueue_at` with a time not in the future is the gem's
# `enqueue_to`, whose answer it does not pass on: a duplicate is not pushed, but the gem's
# after_schedule hooks run and it returns as for a push.) PUSH is found in `<ns>:locket:push`, written by every locketd daemon at
# start and on HUP; until one has, pushes are Resque's own (no holds) with one warning.
# Required before resque, it defines only Locketd::Pusher (PUSH and PUSH_AT on any redis-rb
# client) and says so; `Locketd.install!` then installs the wrappers.

require "redis"

module Locketd
  # Calls PUSH and PUSH_AT on a redis-rb client, with full key names (`namespace` included).
  class Pusher
    FIELDS = {
      push: %w[function sha1 script],
      push_at: %w[function_at sha1_at script_at]
    }.freeze

    # `redis`: a Redis client (not a Redis::Namespace); `namespace`: the Resque namespace,
    # e.g. "resque"; `warn`: called once with a message when no daemon has published PUSH.
    def initialize(redis, namespace, warn: ->(m) { Kernel.warn(m) })
      @redis = redis
      @ns = namespace.to_s
      @warn = warn
      @entry = nil
      @no_functions = false
      @warned = false
    end

    # PUSH of `payload` (the exact bytes) to `queue`: true when pushed, false for a duplicate
    # `unique` refused, nil when no daemon has published PUSH (the caller pushes as Resque does).
    def push(queue, payload)
      run(:push, [key("queue:#{queue}"), key("queues"), key("locket:plans")],
          [queue.to_s, payload, key("locket:")])
    end

    # PUSH_AT of `item` (resque-scheduler's `{"class":…,"args":[…],"queue":…}`, exact bytes) for
    # Unix second `ts`: as #push.
    def push_at(queue, item, ts)
      ts = ts.to_i.to_s
      run(:push_at,
          [key("delayed:#{ts}"), key("timestamps:#{item}"), key("delayed_queue_schedule"),
           key("locket:plans")],
          [queue.to_s, item, ts, key("locket:")])
    end

    private

    def key(name)
      @ns.empty? ? name : "#{@ns}:#{name}"
    end

    def run(op, keys, args)
      entry = @entry || read_entry
      names = entry && entry.values_at(*FIELDS.fetch(op))
      unless names && names[1]
        warn_once(op)
        return nil
      end
      reply = begin
        call(names, keys, args, false)
      rescue Redis::CommandError => e
        raise unless missing?(e)
        # Another build took over, or Redis lost its functions: re-read once, retry once.
        again = read_entry
        again_names = again && again.values_at(*FIELDS.fetch(op))
        call(again_names && again_names[1] ? again_names : names, keys, args, true)
      end
      reply[0].to_i == 1
    end

    def read_entry
      e = @redis.hgetall(key("locket:push"))
      @entry = e.empty? ? nil : e
    end

    def missing?(err)
      err.message.start_with?("NOSCRIPT") || err.message =~ /function not found/i
    end

    # One call: FCALL of the function, else EVALSHA of the script. With `load`, a function not
    # found falls back to the script, loaded if Redis lacks it; without it, "not found" goes to
    # the caller.
    def call(names, keys, args, load)
      function, sha1, script = names
      if function && !function.empty? && !@no_functions
        begin
          return @redis.call("FCALL", function, keys.size, *keys, *args)
        rescue Redis::CommandError => e
          if e.message =~ /unknown command/i
            @no_functions = true
          elsif !load || e.message !~ /function not found/i
            raise
          end
        end
      end
      begin
        @redis.call("EVALSHA", sha1, keys.size, *keys, *args)
      rescue Redis::CommandError => e
        raise unless load && e.message.start_with?("NOSCRIPT")

        @redis.call("SCRIPT", "LOAD", script)
        @redis.call("EVALSHA", sha1, keys.size, *keys, *args)
      end
    end

    def warn_once(op)
      return if @warned

      @warned = true
      what = op == :push_at ? "no PUSH_AT in" : "no"
      @warn.call("locketd: #{what} #{key('locket:push')} (no daemon of this version has " \
                 "started): jobs are pushed without their enqueue-time holds")
    end
  end

  # Raised inside an enqueue for a duplicate, so that the hooks after the push do not run;
  # rescued by the enqueue, which returns false. Never seen by the app.
  class Duplicate < StandardError; end

  # The Pusher on Resque's current connection (`Resque.redis`, a Redis::Namespace), made again
  # when the app sets another.
  def self.pusher
    store = Resque.redis
    return @pusher if @store.equal?(store)

    raw = store.redis
    raw = raw.redis while raw.is_a?(Redis::Namespace)
    @pusher = Pusher.new(raw, store.full_namespace)
    @store = store
    @pusher
  end

  # A push refused as a duplicate: raised inside an enqueue (its later hooks skipped), false
  # outside one.
  def self.refused
    raise Duplicate if Thread.current[:locketd_enqueue]

    false
  end

  # Runs an enqueue; false when its own push was a duplicate. An enqueue made inside it (by a
  # hook) is one of its own, and answers for its own push only.
  def self.enqueue
    outer = Thread.current[:locketd_enqueue]
    Thread.current[:locketd_enqueue] = true
    yield
  rescue Duplicate
    false
  ensure
    Thread.current[:locketd_enqueue] = outer
  end

  # Prepended to Resque's singleton class.
  module ResquePush
    def push(queue, item)
      pushed = Locketd.pusher.push(queue, encode(item))
      return super if pushed.nil?

      pushed || Locketd.refused
    end

    def enqueue_to(queue, klass, *args)
      Locketd.enqueue { super }
    end
  end

  # Prepended to Resque's singleton class when resque-scheduler is loaded.
  module SchedulerPush
    def delayed_push(timestamp, item)
      item_queue = item[:queue] || item["queue"]
      pushed = Locketd.pusher.push_at(item_queue, encode(item), timestamp.to_i)
      return super if pushed.nil?

      pushed || Locketd.refused
    end

    def enqueue_at_with_queue(queue, timestamp, klass, *args)
      Locketd.enqueue { super }
    end
  end

  # Installs the wrappers (done on require when Resque is loaded; call it again after a late
  # `require "resque-scheduler"`).
  def self.install!
    sc = Resque.singleton_class
    sc.prepend(ResquePush) unless sc.include?(ResquePush)
    scheduler = defined?(Resque::Scheduler::DelayingExtensions) &&
                Resque.respond_to?(:delayed_push)
    sc.prepend(SchedulerPush) if scheduler && !sc.include?(SchedulerPush)
  end
end

if defined?(::Resque) && Resque.respond_to?(:push)
  Locketd.install!
else
  Kernel.warn("locketd_resque: Resque is not loaded: only Locketd::Pusher is defined " \
              "(require this file after resque, or call Locketd.install! once it is loaded)")
end
