# frozen_string_literal: true

# Asks locketd to put the job back on its queue (what exit 75 means for a
# command handler). Not a failure: on_failure hooks do not run.
class Rescheduling
  @queue = :default

  def self.perform(*_args)
    raise Locket::Reschedule, "not yet"
  end

  def self.on_failure_log(exception, *_args)
    HookLog.log("Rescheduling.on_failure_log #{exception.class}") # must not run
  end
end
