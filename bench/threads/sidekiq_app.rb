# frozen_string_literal: true

# Sidekiq's side of `locketd-bench threads`: the same app file as locketd's
# (app.rb), and a Sidekiq worker that runs the same job body.
require "sidekiq"
require_relative "app"

class SleepJob
  include Sidekiq::Worker
  sidekiq_options retry: false

  def perform(i)
    Sleep.perform(i)
  end
end
