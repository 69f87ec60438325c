# frozen_string_literal: true

# A plain job: no hooks.
class Greeter
  @queue = :default

  def self.perform(name = "world")
    puts "Hello, #{name}!"
  end
end
