# frozen_string_literal: true

# Prints its args as one line of JSON: checks that payloads arrive byte-exact
# (escaped newlines, U+2028, big integers).
class Echo
  @queue = :default

  def self.perform(*args)
    puts JSON.generate(args)
  end
end
