# frozen_string_literal: true

# Resolved by constant path: {"class":"Namespaced::Job"}.
module Namespaced
  class Job
    @queue = :default

    def self.perform(*args)
      puts "Namespaced::Job #{JSON.generate(args)}"
    end
  end
end
