# frozen_string_literal: true

# The APP_FILE given to adapters/ruby/locketd-ruby: loaded once per handler
# process, before the first job. A real app would load its framework here
# (e.g. require_relative "config/environment").
require "json"

# Appends one line per hook to the file named by $HOOK_LOG (when set), so tests
# can compare the hook order with Resque's.
module HookLog
  def self.log(line)
    path = ENV["HOOK_LOG"]
    return if path.nil? || path.empty?

    File.open(path, "a") { |f| f.puts(line) }
  end
end

Dir[File.join(__dir__, "jobs", "*.rb")].sort.each { |file| require file }
