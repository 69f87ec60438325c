//! The sections of the configuration, in the order the renderings show them.

use super::{Kind, Section};

/// Every section (see [`super::sections`]).
pub(super) const SECTIONS: &[Section] = &[
    Section {
        path: "",
        kind: Kind::Top,
        header: "",
        rules: &["C-1"],
        meaning: "Settings of the daemon as a whole.",
    },
    Section {
        path: "locket",
        kind: Kind::Table,
        header: "[locket]",
        rules: &[],
        meaning: "Job locks, conflicts, liveness and recovery (locking-semantics.md §3). Every \
                  conflict, delay, fencing and parking setting here is the default of the \
                  class setting of the same name.",
    },
    Section {
        path: "queue.<name>",
        kind: Kind::Named,
        header: "[queue.reports]",
        rules: &["A-22"],
        meaning: "Settings of one queue (README \"Operating a fleet\"); the queue list itself is \
                  `queues`. Give every daemon on the Redis the same tables.",
    },
    Section {
        path: "classes.<name>",
        kind: Kind::Named,
        header: "[classes.\"Billing::Sync\"]",
        rules: &["A-5"],
        meaning: "The handler and lock settings of one job class; `[classes.\"*\"]` is the \
                  fallback for every class without a table of its own (tables do not merge). \
                  A job of a class with neither fails as an unknown class. A class runs \
                  `command` (argv, no shell, the payload on stdin), a `builtin` or a named \
                  `handler`. The conflict, delay, fencing and parking settings default to the \
                  `[locket]` values of the same names.",
    },
    Section {
        path: "classes.<name>.locks",
        kind: Kind::Entry,
        header: "locks = [ { key = \"render:{args[0].tenant}\", limit = 3 } ]",
        rules: &["L-4"],
        meaning: "An entry of a class's `locks`: one execution lock; the job takes all of them \
                  or none.",
    },
    Section {
        path: "classes.<name>.holds",
        kind: Kind::Entry,
        header: "holds = [ { name = \"order:{args[0]}\", when = \"enqueue\", release_on = \
                 \"success\" } ]",
        rules: &["D-1"],
        meaning: "An entry of a class's `holds`: a dependency hold the class places, which \
                  classes that name it in `locked_by` wait for.",
    },
    Section {
        path: "classes.<name>.rate",
        kind: Kind::Entry,
        header: "rate = { key = \"gh-api:{args[1]}\", limit = 10, period = \"1s\" }",
        rules: &["RL-1"],
        meaning: "A keyed rate limit, the value of a class's `rate` or an entry of its `rates` \
                  (rate-limits.md): at most `limit` starts of one key in any sliding window of \
                  `period`, fleet-wide, by Redis's clock. A start the rate refuses parks the \
                  job on the key until its time (no polling).",
    },
    Section {
        path: "handlers.<name>",
        kind: Kind::Named,
        header: "[handlers.app]",
        rules: &["H-1"],
        meaning: "Named handlers that classes point at with `handler = \"<name>\"` \
                  (persistent-handlers.md): `mode = \"exec\"` runs `command` once per job, as a \
                  class's `command` does; `mode = \"persistent\"` keeps a process per worker \
                  slot that loads the app once and runs jobs over fds 3 and 4 (README \"Running \
                  Ruby, Python and Node job classes\"). The settings marked persistent apply to \
                  that mode only.",
    },
    Section {
        path: "scheduler",
        kind: Kind::Table,
        header: "[scheduler]",
        rules: &["SC-8"],
        meaning: "The scheduler (resque-scheduler compatible, README \"Scheduling\"): the \
                  master delivers the gem's delayed jobs (Resque.enqueue_in / enqueue_at) when \
                  due and fires the `[schedule.<name>]` tables, only while it holds the gem's \
                  master lock, so one scheduler runs per fleet.",
    },
    Section {
        path: "schedule.<name>",
        kind: Kind::Named,
        header: "[schedule.nightly_report]",
        rules: &["SC-10"],
        meaning: "One recurring schedule: exactly one of `cron` and `every`.",
    },
];
