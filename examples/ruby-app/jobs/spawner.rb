# frozen_string_literal: true

# Leaves background processes behind, each sleeping args[0] seconds:
# a shell's `sleep N &`, a Process.spawn'ed one (detached), and one that left
# the process group with setsid. Prints the pids it knows as JSON.
class Spawner
  @queue = :default

  def self.perform(seconds = 30)
    seconds = seconds.to_i.to_s
    system("sleep #{seconds} &")
    spawned = Process.spawn("sleep", seconds)
    Process.detach(spawned)
    setsid = fork do
      Process.setsid
      exec("sleep", seconds)
    end
    Process.detach(setsid)
    puts JSON.generate("spawned" => spawned, "setsid" => setsid)
  end
end
