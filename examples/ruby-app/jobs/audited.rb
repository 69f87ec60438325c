# frozen_string_literal: true

# Every kind of Resque hook, each logged to $HOOK_LOG. The hooks are defined out
# of alphabetical order on purpose: Resque sorts them by name.
#
# Expected log for a success (Resque::Job#perform):
#   before_perform_a, before_perform_b, around_perform_x enter,
#   around_perform_y enter, perform, around_perform_y exit,
#   around_perform_x exit, after_perform_z
# args[0] changes the story: "fail" raises in perform, "skip" raises
# DontPerform in before_perform_b, "noyield" makes around_perform_y skip perform.
class Audited
  @queue = :default

  def self.before_perform_b(*args)
    HookLog.log("before_perform_b")
    raise Resque::Job::DontPerform if args.first == "skip"
  end

  def self.before_perform_a(*_args)
    HookLog.log("before_perform_a")
  end

  def self.around_perform_y(*args)
    HookLog.log("around_perform_y enter")
    yield unless args.first == "noyield"
    HookLog.log("around_perform_y exit")
  end

  def self.around_perform_x(*_args)
    HookLog.log("around_perform_x enter")
    yield
    HookLog.log("around_perform_x exit")
  end

  def self.perform(*args)
    HookLog.log("perform #{JSON.generate(args)}")
    raise ArgumentError, "audited job failed" if args.first == "fail"
  end

  def self.after_perform_z(*_args)
    HookLog.log("after_perform_z")
  end

  def self.on_failure_log(exception, *args)
    HookLog.log("on_failure_log #{exception.class}: #{exception.message} #{JSON.generate(args)}")
  end
end
