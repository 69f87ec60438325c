# frozen_string_literal: true

# Sleeps args[0] seconds. On SIGTERM the adapter raises Resque::TermException
# inside perform: the ensure block and the on_failure hook still run.
class Slow
  @queue = :low

  def self.perform(seconds = 1)
    HookLog.log("Slow start")
    sleep(seconds.to_f)
    HookLog.log("Slow finished")
  ensure
    HookLog.log("Slow ensure")
  end

  def self.on_failure_note(exception, *_args)
    HookLog.log("Slow.on_failure_note #{exception.class}: #{exception.message}")
  end
end
