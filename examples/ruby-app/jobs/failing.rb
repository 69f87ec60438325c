# frozen_string_literal: true

# Always fails. args[0] == "invalid-utf8" puts invalid UTF-8 bytes in the
# message (the adapter must scrub them); "explode-hook" makes the on_failure
# hook raise too (Resque 2 then reports a RuntimeError "Additional error ...").
class Failing
  @queue = :default

  def self.perform(*args)
    raise "bad bytes: \xFF\xFE end".b if args.first == "invalid-utf8"

    raise "boom: #{args.inspect}"
  end

  def self.on_failure_report(exception, *args)
    HookLog.log("Failing.on_failure_report #{exception.class}: #{exception.message}")
    raise "hook exploded" if args.first == "explode-hook"
  end
end
