# frozen_string_literal: true

# Allocates args[0] MiB and keeps it in a global: the handler's RSS grows job
# after job, until locketd recycles it (max_rss).
class Hog
  @queue = :default
  MIB = 1024 * 1024

  def self.perform(mib = 64)
    ($locket_hog ||= []) << ("x" * (mib.to_i * MIB))
    rss = File.read("/proc/self/status")[/^VmRSS:\s*(\d+)/, 1].to_i / 1024
    puts "Hog: holding #{$locket_hog.size} chunk(s), VmRSS #{rss} MiB"
  end
end
