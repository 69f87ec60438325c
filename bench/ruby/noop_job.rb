# frozen_string_literal: true

# The exec-per-job baseline of `locketd-bench ruby`: a class whose handler is
# `command = ["ruby", "bench/ruby/noop_job.rb"]` starts this script once per job.
# It does nothing, so what it costs is Ruby's own start-up.
