# frozen_string_literal: true

# Starts background processes, each sleeping args[0] seconds: a shell's
# `sleep N &` and a Process.spawn'ed one (detached), which locketd kills when
# the job answers (they are in the handler's process group), and one that left
# the group with setsid, which outlives the job. Prints the pids it knows as JSON.
class Spawner
  @queue = :default

  def self.perform(seconds = 30)
    seconds = seconds.to_i.to_s
    system("sleep #{seconds} &")
    spawned = Process.spawn("sleep", seconds)
    Process.detach(spawned)
    reader, writer = IO.pipe
    setsid = fork do
      reader.close
      Process.setsid
      writer.close # tells the job it left the group: the job must not answer before
      exec("sleep", seconds)
    end
    writer.close
    reader.read # EOF once the child called setsid (or died)
    reader.close
    Process.detach(setsid)
    puts JSON.generate("spawned" => spawned, "setsid" => setsid)
  end
end
