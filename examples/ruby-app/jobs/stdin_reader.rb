# frozen_string_literal: true

# A job reading stdin must get EOF at once (fd 0 is /dev/null), not the
# protocol pipe.
class StdinReader
  @queue = :default

  def self.perform(*_args)
    data = $stdin.read
    raise "stdin was not empty: #{data.bytesize} bytes" unless data.empty?

    puts "StdinReader: stdin is empty"
  end
end
