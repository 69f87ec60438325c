# frozen_string_literal: true

# The app the threaded Ruby adapter tests run (tests/it/adapter_threads.rs, H-18), through
# tests/adapters/drive.py. Every line in $HOOK_LOG starts with the job's tag (args[0]), so
# the order of each job's hooks can be read apart while several jobs run at once.
require "json"
require "open3"

module TagLog
  def self.log(tag, line)
    File.open(ENV.fetch("HOOK_LOG"), "a") { |f| f.puts("#{tag} #{line}") }
  end
end

# args: [tag, seconds, "fail"?]. Every kind of Resque hook; perform sleeps, so jobs overlap.
# perform also logs the fiber-local and thread variable it finds (nil: fresh per job), then
# sets them.
class Tagged
  def self.before_perform_b(tag, *) = TagLog.log(tag, "before_perform_b")
  def self.before_perform_a(tag, *) = TagLog.log(tag, "before_perform_a")

  def self.around_perform_y(tag, *)
    TagLog.log(tag, "around_perform_y enter")
    yield
    TagLog.log(tag, "around_perform_y exit")
  end

  def self.around_perform_x(tag, *)
    TagLog.log(tag, "around_perform_x enter")
    yield
    TagLog.log(tag, "around_perform_x exit")
  end

  def self.perform(tag, seconds, outcome = nil)
    TagLog.log(tag, "perform locals=#{[Thread.current[:tag], Thread.current.thread_variable_get(:tag)].inspect}")
    Thread.current[:tag] = tag
    Thread.current.thread_variable_set(:tag, tag)
    sleep(seconds.to_f)
    raise ArgumentError, "tagged job failed" if outcome == "fail"
  ensure
    TagLog.log(tag, "perform ensure")
  end

  def self.after_perform_z(tag, *) = TagLog.log(tag, "after_perform_z")

  def self.on_failure_log(exception, tag, *)
    TagLog.log(tag, "on_failure_log #{exception.class}")
  end
end

# args: [tag, form, child_seconds, job_seconds]: starts `sleep child_seconds` in the
# background through one subprocess form, logs its outcome, then sleeps job_seconds.
class Spawning
  def self.perform(tag, form, child_seconds, job_seconds)
    secs = child_seconds.to_s
    case form
    when "process_spawn" then Process.spawn("sleep", secs)
    when "kernel_spawn" then spawn("sleep", secs)
    when "system" then TagLog.log(tag, "system #{system("sleep #{secs} >/dev/null 2>&1 &")} #{$?.exitstatus}")
    when "backticks" then TagLog.log(tag, "backticks #{`sleep #{secs} >/dev/null 2>&1 & echo out`.inspect} #{$?.exitstatus}")
    when "popen" then IO.popen(["sleep", secs])
    when "open3" then Open3.popen3("sleep", secs)
    when "fork" then fork { exec("sleep", secs) }
    when "capture" then TagLog.log(tag, "capture #{Open3.capture2("echo", "hi").inspect.sub(/pid \d+/, "pid")}")
    end
    TagLog.log(tag, "#{form} spawned")
    sleep(job_seconds.to_f)
  end
end

# The app's failure backend (H-17): the adapter records a failed job through it.
module Resque
  module Failure
    def self.create(options)
      TagLog.log(options[:payload]["args"][0],
                 "recorded #{options[:exception].class} worker=#{options[:worker]} queue=#{options[:queue]}")
    end
  end
end
