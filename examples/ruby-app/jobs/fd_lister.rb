# frozen_string_literal: true

# Checks that no subprocess of a job inherits the protocol pipes (fds 3 and 4):
# prints `ls -l /proc/self/fd` from a shell, then raises if an exec'd child or a
# forked (not exec'd) child still holds one of the handler's protocol pipes.
class FdLister
  @queue = :default

  def self.perform(*_args)
    puts `ls -l /proc/self/fd`
    protocol = [3, 4].map { |fd| File.readlink("/proc/self/fd/#{fd}") rescue nil }.compact
    protocol.select! { |target| target.start_with?("pipe:") }

    child = Process.spawn("sleep", "5")
    inherited = Dir.children("/proc/#{child}/fd").map(&:to_i).reject { |fd| fd <= 2 }
    Process.kill("KILL", child)
    Process.wait(child)
    raise "an exec'd child inherited fds #{inherited.sort.inspect}" unless inherited.empty?

    reader, writer = IO.pipe
    forked = fork do
      reader.close
      held = Dir.children("/proc/self/fd").map { |fd| File.readlink("/proc/self/fd/#{fd}") rescue nil }
      writer.puts(JSON.generate(held.compact & protocol))
      exit!(0)
    end
    writer.close
    leaked = JSON.parse(reader.read)
    Process.wait(forked)
    raise "a forked child kept the protocol pipes #{leaked.inspect}" unless leaked.empty?

    puts "FdLister: no protocol fd inherited (protocol pipes here: #{protocol.inspect})"
  end
end
