# frozen_string_literal: true

# A before_perform hook vetoes the job: done ok with performed false.
class Skipped
  @queue = :default

  def self.before_perform_veto(*_args)
    raise Resque::Job::DontPerform
  end

  def self.perform(*_args)
    raise "Skipped.perform must not run"
  end

  def self.on_failure_log(exception, *_args)
    HookLog.log("Skipped.on_failure_log #{exception.class}") # must not run either
  end
end
