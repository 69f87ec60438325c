# frozen_string_literal: true

# exit!(args[0]) kills the handler process mid-job (no done frame; locketd
# records it). In --fork mode only the child dies: the parent answers
# Resque::DirtyExit.
class Exiter
  @queue = :default

  def self.perform(code = 3)
    exit!(code.to_i)
  end
end

# A plain `exit` raises SystemExit: an ordinary job failure, the handler lives on.
class SystemExiter
  @queue = :default

  def self.perform(code = 3)
    exit(code.to_i)
  end
end
