# frozen_string_literal: true

# Prints args[0] bytes to stdout without a newline (locketd's line logger must
# cope, e.g. with 10 MB).
class Printer
  @queue = :default

  def self.perform(bytes = 1024)
    $stdout.write("x" * bytes.to_i)
  end
end
