# frozen_string_literal: true

# The Sidekiq 6.4 (Debian ruby-sidekiq) peer of `locketd-bench ruby`: the same
# no-op class body as examples/ruby-app's Noop, as a Sidekiq worker.
require "sidekiq"

class NoopJob
  include Sidekiq::Worker
  sidekiq_options retry: false

  def perform(i); end
end
